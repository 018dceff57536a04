"""``python -m nightjar.api --model smollm2-135m --policy nightjar --port 8000``."""
from __future__ import annotations

import argparse
import json
import os

from nightjar.api.app import serve


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m nightjar.api", description="Serve a Nightjar engine over HTTP")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default="default",
                   help="draft: 'default' (the shipped head), 'independent', a path, 'ngram[:MIN-MAX]' "
                        "(prompt lookup), or 'none'")
    p.add_argument("--policy", default="nightjar", help="off, fixed[:γ], table:..., nightjar, ...")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("NIGHTJAR_API_KEY"),
                   help="require this Bearer key on /v1/*; visible in the process list: prefer NIGHTJAR_API_KEY")
    p.add_argument("--trace", default=None, help="record a replayable trace to this file")
    p.add_argument("--log-level", default="info")
    p.add_argument("--engine-args", default="{}", help="extra EngineConfig fields as JSON, "
                   "e.g. '{\"max_queue\": 64, \"device\": \"cuda\"}'")
    a = p.parse_args(argv)
    kwargs = {"model": a.model, "draft": None if a.draft == "none" else a.draft, "policy": a.policy,
              **json.loads(a.engine_args)}
    if a.served_model_name:
        kwargs["served_model_name"] = a.served_model_name
    serve(kwargs, host=a.host, port=a.port, api_key=a.api_key, trace=a.trace, log_level=a.log_level)


if __name__ == "__main__":
    main()
