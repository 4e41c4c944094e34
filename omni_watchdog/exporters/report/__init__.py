"""The incident report: an incident's bundle read (`bundle`), drawn (`svg`) and laid out
as one self-contained HTML page (`page`)."""
