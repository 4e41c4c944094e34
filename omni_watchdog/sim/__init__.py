"""The simulated vLLM-Omni server, its faults and its NVML stand-in (DESIGN.md section 7)."""
