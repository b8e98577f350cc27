"""A stdio MCP server with N look-up tools, for driving an agent's MCP and tool-search paths.

Usage: ``python tests/support/mcp_inventory.py [N]`` (default 40), as an agent's MCP server
command. It speaks newline-delimited JSON-RPC 2.0 (MCP's stdio transport,
https://modelcontextprotocol.io/specification): ``initialize``, ``tools/list`` (tools
``lookup_0`` .. ``lookup_{N-1}``) and ``tools/call`` (always ``record found``); any other request
gets error -32601, notifications get nothing.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def tools(n: int) -> list[dict[str, Any]]:
    return [
        {
            "name": f"lookup_{i}",
            "description": f"Look up a record of kind {i} in the inventory database.",
            "inputSchema": {
                "type": "object",
                "properties": {"id": {"type": "string", "description": "the record's id"}, "limit": {"type": "integer"}},
                "required": ["id"],
            },
        }
        for i in range(n)
    ]


def main() -> None:
    listed = tools(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message:
            continue
        method = message.get("method")
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": message["id"]}
        if method == "initialize":
            version = message.get("params", {}).get("protocolVersion", "2025-06-18")
            reply["result"] = {"protocolVersion": version, "capabilities": {"tools": {}},
                               "serverInfo": {"name": "inventory", "version": "1"}}
        elif method == "tools/list":
            reply["result"] = {"tools": listed}
        elif method == "tools/call":
            reply["result"] = {"content": [{"type": "text", "text": "record found"}]}
        else:
            reply["error"] = {"code": -32601, "message": f"method not found: {method}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
