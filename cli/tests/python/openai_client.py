"""duet's OpenAI-compatible door, driven by the official `openai` Python package.

Usage: openai_client.py BASE_URL   (e.g. http://127.0.0.1:8000/v1)

Prints one JSON object with what the client saw; the Rust test compares it with the gRPC
door's greedy output and checks the errors. Exits non-zero when the client raises where it
should not.
"""

import json
import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
out = {}

models = client.models.list()
out["models"] = [m.id for m in models.data]
model = out["models"][0]

prompt = "The capital of France is"
c = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
out["completion"] = {
    "text": c.choices[0].text,
    "finish_reason": c.choices[0].finish_reason,
    "usage": c.usage.model_dump(),
    "object": c.object,
}

text = ""
finish = None
usage = None
chunks = 0
for ch in client.completions.create(
    model=model,
    prompt=prompt,
    max_tokens=8,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
):
    chunks += 1
    if ch.choices:
        text += ch.choices[0].text
        finish = ch.choices[0].finish_reason or finish
    if ch.usage is not None:
        usage = ch.usage.model_dump()
out["completion_stream"] = {"text": text, "finish_reason": finish, "usage": usage, "chunks": chunks}

messages = [{"role": "user", "content": "What is the capital of France?"}]
r = client.chat.completions.create(
    model=model, messages=messages, max_completion_tokens=12, temperature=0, seed=7
)
out["chat"] = {
    "text": r.choices[0].message.content,
    "role": r.choices[0].message.role,
    "finish_reason": r.choices[0].finish_reason,
    "usage": r.usage.model_dump(),
}

text = ""
roles = []
finish = None
for ch in client.chat.completions.create(
    model=model, messages=messages, max_tokens=12, temperature=0, stream=True
):
    for choice in ch.choices:
        if choice.delta.role:
            roles.append(choice.delta.role)
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
out["chat_stream"] = {"text": text, "roles": roles, "finish_reason": finish}

# vLLM's extra sampling fields go through the client's extra_body.
r = client.completions.create(
    model=model,
    prompt=prompt,
    max_tokens=5,
    temperature=0.8,
    top_p=0.9,
    seed=1234,
    extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
)
out["extras"] = {"completion_tokens": r.usage.completion_tokens}

errors = {}
try:
    client.completions.create(model=model, prompt=prompt, max_tokens=4, n=2)
except openai.BadRequestError as e:
    errors["n"] = {"status": e.status_code, "param": (e.body or {}).get("param")}
try:
    client.completions.create(model="no-such-model", prompt=prompt, max_tokens=4)
except openai.NotFoundError as e:
    errors["model"] = {"status": e.status_code}
try:
    client.chat.completions.create(model=model, messages=[], max_tokens=4)
except openai.BadRequestError as e:
    errors["messages"] = {"status": e.status_code, "param": (e.body or {}).get("param")}
out["errors"] = errors

print(json.dumps(out))
