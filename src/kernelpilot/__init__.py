"""kernelpilot: write, verify and time fast CUDA kernels for PyTorch code.

The pipeline flows one way: problem -> workspace -> build -> verify -> bench -> reward.
"""

__version__ = "0.1.0"
