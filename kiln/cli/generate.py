"""`kiln generate PROMPT`: one prompt, the reply streamed to stdout as it is generated."""

from __future__ import annotations

import argparse
import sys

from kiln.cli.engine_args import engine_kwargs, sampling_params
from kiln.llm import LLM


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # a bad flag fails before the model loads
    llm = LLM(args.model, **engine_kwargs(args))
    prompt = args.prompt
    if not args.raw and llm.tokenizer.has_chat_template:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompt = llm.chat_prompt([*system, {"role": "user", "content": prompt}])
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
