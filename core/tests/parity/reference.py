#!/usr/bin/env python3
"""Reference token ids for core/tests/tokenizer_parity.rs, computed with Hugging Face transformers.

Usage: reference.py MODEL_DIR CASES_JSON  -> prints {"chats": {name: {...}}, "completions": {...}}

Chat bodies are prepared the way vLLM 0.33 prepares them before `apply_chat_template`
(vllm/renderers/chat_utils/chat_message.py, renderers/hf.py, the chat request's
build_chat_params; re-stated here because vLLM itself needs torch), then rendered with
`tokenizer.apply_chat_template(..., tokenize=False)` and tokenised with
`tokenizer(text, add_special_tokens=...)`. Completion prompts are tokenised with
`tokenizer(prompt, add_special_tokens=...)` (default true) or passed through as ids.
Each result is {"text": ..., "ids": [...]} or {"error": "..."}.
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from transformers import AutoTokenizer  # noqa: E402

TEXT_PART_TYPES = {"text", "input_text", "output_text", "refusal", "thinking"}


def merge_kwargs(defaults, overrides):
    defaults = dict(defaults or {})
    for k, v in (overrides or {}).items():
        if v is None or v == "auto":
            continue
        defaults[k] = v
    return defaults


def normalise_tool(tool):
    fn = tool["function"]
    f = {
        "name": fn["name"],
        "description": fn.get("description"),
        "parameters": fn.get("parameters"),
    }
    if fn.get("strict") is not None:
        f["strict"] = fn["strict"]
    defer = fn.get("defer_loading")
    if defer is None:
        defer = tool.get("defer_loading")
    if defer is not None:
        f["defer_loading"] = defer
    out = {"type": "function", "function": f}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def part_text(part):
    if isinstance(part, str):
        return part
    ptype = part.get("type")
    if ptype in TEXT_PART_TYPES:
        field = {"refusal": "refusal", "thinking": "thinking"}.get(ptype, "text")
        return part.get(field)
    raise ValueError(f"unsupported part {ptype}")


def strip_billing_header(parts):
    out = []
    for part in parts:
        if isinstance(part, str):
            text = part
        elif isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith("x-anthropic-billing-header")):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if not rest:
            continue
        out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def parse_message(msg):
    msg = dict(msg)
    rc = msg.pop("reasoning_content", None)
    if rc is not None and msg.get("reasoning") is None:
        msg["reasoning"] = rc
    role = msg["role"]
    content = msg.get("content")
    reasoning = msg.get("reasoning")
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if role == "system":
        content = strip_billing_header(content)
    texts = []
    for part in content:
        t = part_text(part)
        if t is None and (isinstance(part, dict) and part.get("type") in ("text", "refusal")):
            continue
        texts.append(t)
    result = {"role": role, "content": "\n".join(texts)}
    if role == "assistant":
        if msg.get("tool_calls") is not None:
            result["tool_calls"] = [dict(c, function=dict(c["function"])) for c in msg["tool_calls"]]
        if reasoning is not None:
            result["reasoning"] = reasoning
            result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in msg:
            result["tool_call_id"] = msg["tool_call_id"]
    if isinstance(msg.get("name"), str):
        result["name"] = msg["name"]
    return result


def postprocess(messages):
    for m in messages:
        if m["role"] == "assistant" and "tool_calls" in m:
            calls = m["tool_calls"]
            if len(calls) == 0:
                m.pop("tool_calls")
                continue
            for item in calls:
                fn = item["function"]
                args = fn.get("arguments")
                if args:
                    if isinstance(args, dict):
                        parsed = args
                    else:
                        if isinstance(args, str):
                            try:
                                parsed = json.loads(args)
                            except json.JSONDecodeError:
                                parsed = None
                        else:
                            parsed = args
                        if not isinstance(parsed, dict):
                            parsed = {}
                    fn["arguments"] = parsed
                else:
                    fn["arguments"] = {}


def render_chat(tok, body):
    agp = body.get("add_generation_prompt", True)
    cfm = body.get("continue_final_message", False)
    if agp and cfm:
        raise ValueError("both add_generation_prompt and continue_final_message")
    tools = body.get("tools")
    tool_dicts = None if tools is None else [normalise_tool(t) for t in tools]
    user_kwargs = body.get("chat_template_kwargs") or {}
    extras = dict(add_generation_prompt=agp, continue_final_message=cfm,
                  documents=body.get("documents"))
    effort = body.get("reasoning_effort")
    if effort is not None:
        extras["reasoning_effort"] = effort
        if "enable_thinking" not in user_kwargs:
            extras["enable_thinking"] = effort != "none"
    overrides = merge_kwargs(user_kwargs, extras)
    defaults = merge_kwargs({}, dict(tools=tool_dicts))
    kwargs = merge_kwargs(defaults, overrides)
    tools = kwargs.pop("tools", None)
    conversation = [parse_message(m) for m in body["messages"]]
    postprocess(conversation)
    text = tok.apply_chat_template(conversation, tools=tools, tokenize=False, **kwargs)
    ids = tok(text, add_special_tokens=body.get("add_special_tokens", False))["input_ids"]
    return {"text": text, "ids": ids}


def completion(tok, body):
    prompt = body["prompt"]
    asp = body.get("add_special_tokens", True)

    def one(p):
        if isinstance(p, str):
            return tok(p, add_special_tokens=asp)["input_ids"]
        return list(p)

    if isinstance(prompt, str) or (prompt and all(isinstance(x, int) for x in prompt)):
        return {"ids": one(prompt)}
    return {"ids": [one(p) for p in prompt]}


def main():
    model_dir, cases_path = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    out = {"chats": {}, "completions": {}}
    for case in cases["chats"]:
        try:
            out["chats"][case["name"]] = render_chat(tok, case["body"])
        except Exception as e:  # noqa: BLE001 - the error itself is the expected result
            out["chats"][case["name"]] = {"error": f"{type(e).__name__}: {e}"}
    for case in cases["completions"]:
        try:
            out["completions"][case["name"]] = completion(tok, case["body"])
        except Exception as e:  # noqa: BLE001
            out["completions"][case["name"]] = {"error": f"{type(e).__name__}: {e}"}
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
