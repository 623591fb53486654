"""The BCP-shaped workload's two tools over MCP, served the way BrowseComp-Plus's
`searcher/mcp_server.py` serves them: tools `search(query)` (the top-k hits as docid and snippet)
and `get_document(docid)` (docid and full text, or null), so BCP's own MCP clients run against
sgl-memory and this corpus unchanged. Retrieval is the workload's own (bench/agent/bcp.py: BM25,
results frozen per query).

    python -m bench.agent.mcp_server --transport streamable-http --port 8000   # http://127.0.0.1:8000/mcp
    python -m bench.agent.mcp_server --transport sse --port 8000               # http://127.0.0.1:8000/sse
    python -m bench.agent.mcp_server --transport stdio                       # a client starts it itself
    ... --bcp-corpus corpus.jsonl                                            # BCP's corpus instead of LoCoMo's
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mcp.server.fastmcp import FastMCP

from . import bcp


def build(corpus: bcp.Corpus, k: int = bcp.TOP_K, port: int = 8000, snippet_words: int = bcp.SNIPPET_WORDS) -> FastMCP:
    """`mcp` 1.x's FastMCP, which BCP's own server (fastmcp 2.9) and its qwen-agent client build on:
    qwen-agent 0.0.34 does not run on `mcp` 2.x."""
    server = FastMCP(name="search-server", port=port)

    @server.tool(
        name="search",
        description=f"Search the corpus; returns the top {k} documents as docid and the "
        f"first {snippet_words} words of their text.",
    )
    def search(query: str) -> list[dict]:
        return [{"docid": d.docid, "snippet": bcp.snippet(d, snippet_words)} for d in corpus.search(query, k)]

    @server.tool(name="get_document", description="The full text of one document, by its docid.")
    def get_document(docid: str) -> dict | None:
        doc = corpus.by_id.get(docid)
        return None if doc is None else {"docid": doc.docid, "text": f"{doc.title}\n{doc.text}"}

    return server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.agent.mcp_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", choices=("stdio", "sse", "streamable-http"), default="sse")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--k", type=int, default=bcp.TOP_K)
    ap.add_argument("--snippet-words", type=int, default=bcp.SNIPPET_WORDS, help="words of each hit's text")
    ap.add_argument("--bcp-corpus", type=Path, help="BCP's corpus jsonl (docid, text[, title, url])")
    ap.add_argument(
        "--cache",
        type=Path,
        help="the frozen search cache to share with runs (bench/agent's agent_bcp.search_cache.json)",
    )
    args = ap.parse_args(argv)
    docs = bcp.bcp_corpus(args.bcp_corpus) if args.bcp_corpus else bcp.locomo_corpus()
    build(bcp.Corpus(docs, args.cache), args.k, args.port, args.snippet_words).run(args.transport)


if __name__ == "__main__":
    main()
