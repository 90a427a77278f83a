"""``countdown serve MODEL``: transformers' OpenAI-compatible server on a countdown model, in this process.

    countdown save ... (or countdown.save in Python), then
    countdown serve my-folder --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
         -d '{"model": "my-folder", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}'

A folder or a hub id is loaded by transformers' server itself (``from_pretrained``: after ``import countdown`` a
folder written by ``countdown.save`` comes back sparsified and / or 4-bit as saved); a catalogue name or a .gguf file
is loaded by :func:`countdown.load_model` and handed to the server. :func:`countdown.serving.serving` serves it until
Ctrl-C or SIGTERM. Needs ``pip install 'countdown[serve]'``.
"""

from __future__ import annotations

import argparse
import sys

from ..options import add_device_arg, add_number


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``countdown serve`` (see the module docstring)."""
    p.add_argument("model", help="a folder or hub id, which transformers' server loads (a model countdown.save wrote: "
                                 "as saved, sparsified and / or 4-bit), or a catalogue name or .gguf file (dense); "
                                 "requests name it as given here")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    add_number(p, "--port", range="port", default=8000, help="port to listen on; 0: a free one (default 8000)")
    add_device_arg(p)
    p.add_argument("--dtype", default="auto", help="fp32, bf16, fp16 or auto: bf16 on cuda, fp32 on cpu (default auto)")
    p.add_argument("--transformers-generate", action="store_true",
                   help="every request through transformers' own generate (default: countdown.generate, the fast "
                        "decode step, for the requests it serves exactly; the others through transformers')")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="the server's log level (default warning)")
    return p


def cmd_serve(args) -> int:
    from ..data.models import model_source, parse_dtype
    from ..serving import _serve_modules, serving

    _serve_modules()  # a missing serving extra stops here, before the model load
    cuda = str(args.device).startswith("cuda")
    dtype = parse_dtype(("bf16" if cuda else "fp32") if args.dtype == "auto" else args.dtype)
    if model_source(args.model)[0] in ("folder", "hub"):  # the server loads it: from_pretrained, countdown's quantizer
        model, tok, loading = args.model, None, {"device": str(args.device), "dtype": str(dtype).removeprefix("torch.")}
    else:  # a catalogue name or a .gguf file: countdown's loader, the object handed to the server
        import countdown

        (model, tok), loading = countdown.load_model(args.model, dtype=dtype, device=args.device), {}
    with serving(model, tok, args.model, host=args.host, port=args.port, fast=not args.transformers_generate,
                 log_level=args.log_level, **loading) as server:
        how = "transformers' generate" if server.route is None else "countdown.generate where it can"
        print(f"serving {args.model} at {server.url}/v1 (model name {args.model!r}; {how}); Ctrl-C stops",
              flush=True)
        try:
            while server.thread.is_alive():
                server.thread.join(0.5)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (countdown.cli.commands turns it into one): the normal stop
            pass
        if server.route is not None:
            calls = server.route.calls
            print(f"stopped: {calls['countdown']} requests through countdown.generate, {calls['transformers']} "
                  "through transformers' generate", file=sys.stderr)
    return 0
