"""SGLang 0.5.23 on a host without CUDA, for the SGLang suite and `cpcache bench
sglang`: servers.py starts real servers (and `cpcache launch` daemons);
cpu_host/ goes on every SGLang process's PYTHONPATH (stand-ins for its
GPU-only imports, and SGLang's own HiCache made to run on the CPU)."""
