"""Interactive chat: type a message, the reply streams back. /reset clears, /exit quits."""

from __future__ import annotations

import argparse
import sys

from kiln.cli.engine_args import engine_kwargs, sampling_params
from kiln.errors import InvalidRequestError
from kiln.llm import LLM


def run(args: argparse.Namespace) -> int:
    sampling_params(args)  # a bad flag fails before the model loads
    llm = LLM(args.model, **engine_kwargs(args))
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    print("kiln chat: /reset clears the conversation, /exit (or Ctrl-D) quits", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = list(base)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        try:
            reply = _stream_reply(llm, messages, args)
        except InvalidRequestError as exc:
            messages.pop()
            print(f"error: {exc} (try /reset)", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})


def _stream_reply(llm, messages: list[dict], args: argparse.Namespace) -> str:
    text = ""
    for out in llm.stream(llm.chat_prompt(messages), sampling_params(args)):
        delta = out.outputs[0].delta_text
        text += delta
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return text
