"""The spec language and its tables: spec (YAML → models), compile (checks, grammar, LALR tables,
conflict explanations), registry and detect (bundled formats, precedence), cache, norms.
"""
