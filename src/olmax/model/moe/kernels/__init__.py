"""The experts' grouped matmul as Pallas Mosaic GPU kernels (impl.moe.dispatch=grouped): grouped.matmul, the
entry, runs the kernels of a chip (chip.py) for each product: Hopper's (hopper.py), Blackwell's (blackwell.py),
and Blackwell's MXFP8 ones (mxfp8.py), each module with its kernels' tuning and their work for the step-time
model."""
