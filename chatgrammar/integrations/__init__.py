"""Integrations of chatgrammar with training clients, each an optional extra.

Every submodule imports its client lazily (inside the functions that need it), so
``import chatgrammar`` and ``import chatgrammar.integrations`` never import torch, trl,
modelopt or ray.

- :mod:`chatgrammar.integrations.trl` — ``prepare`` a dataset for TRL's ``SFTTrainer``
  (``pip install 'chatgrammar[trl]'``).
- :mod:`chatgrammar.integrations.modelopt` — a Model-Optimizer ``LossMaskRecovery``
  (``pip install 'chatgrammar[modelopt]'``).
"""
