"""``moetrace calibrate``: measures, with real kernels on the GPUs present, MoE expert time against unique experts
and rows (bf16 and fp8 grouped GEMMs, at a model's per-rank shapes), the weight bandwidth those kernels reach (from
which INT4 is estimated), NCCL all-reduce time against message size for every group of GPUs the machine allows,
and a model drafter's passes (``drafter``). The command is ``moetrace.commands.calibrate``.

Torch is imported lazily inside the measuring modules (``experts``, ``allreduce``, ``run``); ``fit`` and this
module are plain Python, so ``moetrace --help`` stays fast and the analysis side can read a calibration without
torch. ``python -m moetrace.calibrate.run`` runs the whole measurement with torch alone (no click, rich or polars).
"""

SCHEMA = "moetrace-calibration/1"
