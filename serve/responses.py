"""The gateway's JSON response for error bodies."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


class SafeJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a lone surrogate from a hostile request
    (echoed in an error's message) cannot make the body unencodable."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()
