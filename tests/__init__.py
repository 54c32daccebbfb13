"""chatgrammar's test suite (a package, so helpers import as ``from tests.tokenizers import ...``)."""
