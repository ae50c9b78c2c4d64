# kernel, not kernels: a kernels package on sys.path (pytest run from tests/) would shadow HuggingFace's kernels.
