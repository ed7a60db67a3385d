#!/usr/bin/env python3
"""Does llama.cpp convert a Gemma 4 pair to GGUF and generate what the original generates? (a consumer check)

A program of its own: it runs under the python of the llama.cpp env (scripts/consumers/llamacpp/requirements.txt,
setup_env.py), never imports the converter, and writes one JSON document. For the reference pair and each pair
given, the target and the assistant go through llama.cpp's own `convert_hf_to_gguf.py` (float32, the vendored
copy of the llama.cpp that llama-cpp-python runs); then:

- every GGUF tensor (name, type, shape, sha256 of its bytes) and the model's metadata, for the caller to compare
  with the original's GGUF;
- the target GGUF in llama.cpp's runtime (llama-cpp-python, CPU): the logits of a fixed prompt and NEW_TOKENS greedy
  tokens, fed as token ids.

The synthetic checkpoints carry a stub tokenizer (the converter copies tokenizer files byte for byte, so none is
under test), and the GGUF converter needs a real one: each directory is staged with links to its files and a small
byte-fallback BPE tokenizer of the config's vocabulary size in place of the stub. A step llama.cpp fails records
the error (one line); the caller judges (tests/test_consumer_llamacpp.py). The synthetic configs also leave out
`moe_intermediate_size` where there are no experts, which every config transformers writes carries (null) and
llama.cpp requires: the staged config.json gets it, null, where it is absent (the report lists what was added).

usage: check.py --reference PAIR [--pair NAME=PAIR ...] --json OUT   (PAIR: a directory holding target/ and assistant/)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/consumers: run by path, not as a package
from consumer_io import NEW_TOKENS, PROMPT, one_line, parse_pairs, text_config_of  # noqa: E402

LLAMA_CPP = Path(sys.prefix) / "llama.cpp"  # setup_env.py unpacked the GGUF converter here
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")  # Gemma's ids 0-3
# architecture-neutral metadata that names the file rather than the model
IGNORED_METADATA = ("general.name", "general.basename", "general.size_label", "general.file_type")
F32 = 0  # ggml_type: the KV cache in float32 (llama.cpp's default, float16, rounds what the layouts compare)
ALWAYS_WRITTEN = {"moe_intermediate_size": None}  # Gemma4TextConfig's default, in every config transformers writes


def vocab_size(config: dict) -> int:
    return text_config_of(config)["vocab_size"]


def write_tokenizer(directory: Path, size: int) -> None:
    """A byte-fallback BPE tokenizer (what LlamaHfVocab accepts) with `size` tokens, one merge (llama.cpp's gemma4
    vocabulary requires merges) and Gemma's special ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    pieces = [*SPECIALS, "<0x0A>", "▁", "a", "b", "ab"]
    pieces += [f"t{i}" for i in range(size - len(pieces))]
    bpe = models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[("a", "b")], unk_token="<unk>",
                     byte_fallback=True)
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens(list(SPECIALS))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}))


def stage(model: Path, into: Path) -> tuple[Path, list[str]]:
    """(`into`: links to every file of `model` but its tokenizer and config, the test tokenizer, the config with the
    keys transformers always writes; those keys)."""
    into.mkdir(parents=True)
    for item in model.iterdir():
        if item.name not in TOKENIZER_FILES + ("config.json",):
            os.symlink(item.resolve(), into / item.name)
    config = json.loads((model / "config.json").read_text())
    text = text_config_of(config)
    added = [key for key in ALWAYS_WRITTEN if key not in text]
    text.update({key: ALWAYS_WRITTEN[key] for key in added})
    (into / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(into, vocab_size(config))
    return into, added


def convert(model: Path, work: Path, name: str) -> tuple[Path | None, str | None, list[str]]:
    """(the GGUF or None, llama.cpp's error or None, the config keys staging added)."""
    out = work / f"{name}.gguf"
    staged, added = stage(model, work / name)
    proc = subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(staged), "--outtype", "f32",
                           "--outfile", str(out)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not out.is_file():
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return None, (lines[-1] if lines else f"exit {proc.returncode}")[:300], added
    return out, None, added


def describe(gguf_file: Path) -> dict:
    """{"tensors": {name: [type, shape, sha256]}, "metadata": {key: value}} of a GGUF file (gguf-py's reader)."""
    sys.path.insert(1, str(LLAMA_CPP / "gguf-py"))
    import gguf

    reader = gguf.GGUFReader(gguf_file)
    tensors = {t.name: [t.tensor_type.name, [int(n) for n in t.shape], hashlib.sha256(t.data.tobytes()).hexdigest()]
               for t in reader.tensors}
    metadata = {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name.startswith("tokenizer.") or field.name in IGNORED_METADATA:
            continue
        value = field.contents()
        metadata[field.name] = value if isinstance(value, (int, float, str, list, bool)) else str(value)
    return {"tensors": tensors, "metadata": metadata}


def run_target(gguf_file: Path) -> dict:
    """The prompt's logits and greedy tokens in llama.cpp's runtime (one sequence, the whole prompt each step: no
    cache state to differ between layouts)."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_file), n_ctx=64, n_batch=64, n_threads=2, logits_all=True, verbose=False,
                seed=0, type_k=F32, type_v=F32)
    tokens = list(PROMPT)
    for _ in range(NEW_TOKENS):
        llm.reset()
        llm.eval(tokens)
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    llm.reset()
    llm.eval(list(PROMPT))
    logits = np.array(llm.scores[:len(PROMPT)], dtype=np.float64)
    return {"greedy": tokens, "logits": logits.tolist()}


def check_pair(pair: Path, work: Path) -> dict:
    result: dict = {}
    for role in ("target", "assistant"):
        gguf_file, error, added = convert(pair / role, work, role)
        result[f"{role}_error"], result[f"{role}_config_added"] = error, added
        if gguf_file is not None:
            result[f"{role}_gguf"] = describe(gguf_file)
        if role == "target" and gguf_file is not None:
            try:
                result.update(run_target(gguf_file))
            except Exception as exc:  # noqa: BLE001 - any failure of the consumer is the finding, one line
                result["runtime_error"] = one_line(exc)
    return result


def main(argv: list[str] | None = None) -> int:
    pairs, out = parse_pairs(__doc__.splitlines()[0], argv)
    from importlib.metadata import version

    report = {"llama_cpp_python": version("llama-cpp-python"), "transformers": version("transformers"),
              "converter": (LLAMA_CPP / "VERSION").read_text().strip(), "pairs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, pair in pairs.items():
            report["pairs"][name] = check_pair(pair, Path(tmp) / name)
    out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
