"""Reference token ids for model/tests/tokenizer.rs, from an implementation independent of ragkv.

The `gguf` package (llama.cpp's reader) reads the file's tokenizer metadata; Hugging Face
transformers' own GGUF converter (`transformers.integrations.gguf`) turns it into a tokenizer, run
by the `tokenizers` library. ragkv builds its tokenizer from the same metadata with its own code.
The output JSON records the versions used. (transformers' file reader needs torch, so the
metadata is read with `gguf` and handed to the converter as transformers' reader would.)

    python3 -m venv /tmp/tokref && /tmp/tokref/bin/pip install transformers gguf sentencepiece
    /tmp/tokref/bin/python make_tokenizer_refs.py ~/.cache/ragkv/models/SmolLM2-135M-Instruct.Q4_1.gguf > smollm2_tokens.json
    /tmp/tokref/bin/python make_tokenizer_refs.py ~/.cache/ragkv/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf > qwen2_5_coder_tokens.json
"""
import importlib.metadata
import json
import os
import sys

import gguf
import tokenizers
import transformers
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_TOKENIZER_MAPPING,
    convert_gguf_tokenizer,
)

STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n  indented",
    "Numbers: 0 7 42 1234567890 3.14159 -17 1e10",
    "Unicode: café naïve façade Zürich São Paulo",
    "中文，日本語のテキスト、한국어 텍스트",
    "Emoji: 🚀🔥👍🏽 and ∑∫√∞ math",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment",
    "fn main() { println!(\"{}\", a.iter().map(|x| x * 2).sum::<i32>()); }",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "don't can't it's we're they've I'm you'll he'd",
    "URL https://example.org/a/b?c=d&e=f#g and email a.b@example.com",
    "",
]


def field_value(field):
    """A GGUF metadata value as Python data (strings decoded, arrays as lists)."""
    types = field.types
    if types[0] == gguf.GGUFValueType.ARRAY:
        items = [field.parts[i] for i in field.data]
        if types[1] == gguf.GGUFValueType.STRING:
            return [bytes(x).decode("utf-8") for x in items]
        return [x.tolist()[0] for x in items]
    part = field.parts[field.data[0]]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def main(path: str) -> None:
    name = os.path.basename(path)
    reader = gguf.GGUFReader(path)
    metadata = {k: field_value(f) for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general.architecture"))}
    tokenizer_dict = {
        renamed: metadata[f"tokenizer.{key}"]
        for key, renamed in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in metadata
    }
    tok, _ = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    cases = [{"text": s, "ids": tok.encode(s, add_special_tokens=False).ids} for s in STRINGS]
    provenance_and_cases = (
        {
            "provenance": {
                "model_file": name,
                "generator": "model/tests/reference/make_tokenizer_refs.py",
                "implementation": "transformers GGUF tokenizer conversion + tokenizers",
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
                "gguf": importlib.metadata.version("gguf"),
            },
            "cases": cases,
        }
    )
    # One case per line, so that diffs of the reference file stay readable.
    out = json.dumps({**provenance_and_cases, "cases": []}, ensure_ascii=False, indent=1)
    rows = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    sys.stdout.write(out.replace('"cases": []', '"cases": [\n' + rows + "\n ]") + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
