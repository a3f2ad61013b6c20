"""End-to-end DLRM trainer on the four packages (the README's main job).

``python -m examples.dlrm.launch`` trains 2 processes on CPU (gloo) through torchrun;
``torchrun --nproc-per-node N -m examples.dlrm.train --out DIR`` runs the workers directly (NCCL on GPUs).
"""
