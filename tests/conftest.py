"""Suite-wide settings. pytest runs with one worker per core (-n 2): a torch thread pool per worker on top of that
oversubscribes the cores, and tiny ops then spend milliseconds spinning on each other, so each worker gets one."""

import torch

torch.set_num_threads(1)
