"""Where the kernel tests run: CUDA when there is a GPU, else the Triton interpreter on CPU."""

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
