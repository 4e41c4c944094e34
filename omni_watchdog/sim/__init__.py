"""The simulated vLLM-Omni server, its faults and its NVML stand-in.

See docs/design.md, The simulated server.
"""
