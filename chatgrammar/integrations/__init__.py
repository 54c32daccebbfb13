"""Integrations with the trainers and data engines chatgrammar is used in.

Each client is optional and imported only by its own module, never by ``import chatgrammar`` or
by this package:

- :mod:`chatgrammar.integrations.modelopt` — NVIDIA Model-Optimizer's loss-mask recoveries and
  final-norm selection (``pip install 'chatgrammar[modelopt]'``);
- :mod:`chatgrammar.integrations.trl` — TRL's ``SFTTrainer`` datasets (``[trl]``).

Importing this package imports nothing heavy (no torch, no client).
"""
