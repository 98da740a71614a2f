"""``zerostall bench`` and the measurements behind docs/benchmarks.md: zerostall against torch.save,
PyTorch DCP and other checkpointers on the same disk, in the same run. Installed beside zerostall
(``pip install -e ./bench`` from a checkout); the library never imports it."""
