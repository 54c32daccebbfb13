"""chatgrammar — declarative chat-format grammars and loss masks.

Example:
    >>> import chatgrammar as cg
    >>> fmt = cg.load_format("kimi-k2")
    >>> conv = fmt.parse("<|im_user|>user<|im_middle|>Hi<|im_end|>"
    ...                  "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>")
    >>> conv.trained_text()
    ['Hello!']
"""
from .errors import (ChatGrammarError, CompileError, DetectionError, DeviationWarning,
                     InferenceError, NormError,
                     ParseError, SpecError)
from .runtime.format import Format
from .runtime.policy import MaskPolicy
from .core.registry import list_formats, load_format
from .runtime.spans import Block, Conversation, Issue, Span, Turn
from .core.detect import detect_format, explain_detection

from .conformance.infer import infer_format

from .core.norms import (FinalNorm, build_final_norm, explain_final_norm, final_norm_kind,
                         resolve_final_norm)

__version__ = "0.1.0"

__all__ = [
    "list_formats", "load_format", "detect_format", "explain_detection", "Format", "Conversation", "Turn", "Span",
    "Block", "Issue", "MaskPolicy", "resolve_final_norm", "final_norm_kind", "FinalNorm",
    "explain_final_norm", "build_final_norm",
    "ChatGrammarError", "SpecError", "CompileError", "ParseError", "DetectionError",
    "NormError", "InferenceError", "DeviationWarning", "infer_format",
]
