"""Small I/O helpers shared by the CLI commands and the checkers."""
from __future__ import annotations

from pathlib import Path
from typing import Callable


def read_text(path: str | Path, error: Callable[[str], Exception]) -> str:
    """Read a UTF-8 text file, turning every failure into ``error(one-line message)``.

    Args:
        path: the file.
        error: builds the exception to raise (a usage error in a command, a ChatGrammarError
            in a library call).

    Returns:
        The file's text.

    Raises:
        Whatever ``error`` builds: missing file, a directory, not UTF-8, unreadable.
    """
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"no such file: {p}") from None
    except IsADirectoryError:
        raise error(f"is a directory: {p}") from None
    except UnicodeDecodeError as exc:
        raise error(f"cannot read {p}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise error(f"cannot read {p}: {exc.strerror or exc}") from None
