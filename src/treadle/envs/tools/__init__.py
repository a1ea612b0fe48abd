"""Agent tools: one small interface (`Tool`), results that are observations, not exceptions.

- `python`, `bash`: run code in the episode's sandbox (`exec.py`).
- `read_file`, `write_file`: the sandbox work dir (`files.py`).
- `apply_patch`: unified diffs, applied in pure Python (`patch.py`).
- `search`: BM25 over a local corpus (`search.py`).
- `submit_answer`: the final answer; ends the episode (`answer.py`).

The contracts (errors as observations, latency on every call, code only in a
sandbox) are in `base.py`.
"""

from treadle.envs.tools.answer import SubmitAnswerTool
from treadle.envs.tools.base import (
    Tool,
    ToolContext,
    ToolInputError,
    ToolRecord,
    ToolResult,
    clip,
)
from treadle.envs.tools.exec import BashTool, PythonTool
from treadle.envs.tools.files import ReadFileTool, WriteFileTool
from treadle.envs.tools.patch import ApplyPatchTool, PatchError, apply_hunks, parse_unified_diff
from treadle.envs.tools.search import BM25Index, Document, SearchTool, tokenize

__all__ = [
    "ApplyPatchTool",
    "BM25Index",
    "BashTool",
    "Document",
    "PatchError",
    "PythonTool",
    "ReadFileTool",
    "SearchTool",
    "SubmitAnswerTool",
    "Tool",
    "ToolContext",
    "ToolInputError",
    "ToolRecord",
    "ToolResult",
    "WriteFileTool",
    "apply_hunks",
    "clip",
    "parse_unified_diff",
    "tokenize",
]
