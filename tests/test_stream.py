"""Streaming detokenization: never half a UTF-8 character, never a dropped character."""

from edgekv.format.bundle import load_bundle
from edgekv.runtime.text import StreamDecoder, TextCodec

TEXTS = ["The capital of France is Paris.", "naïve café 東京 🙂🙂 ünïcödé", "emoji 🙂 and tea\n\nnew  lines"]


def test_stream_equals_whole_decode(tiny_bundle_int8):
    codec = TextCodec(load_bundle(tiny_bundle_int8))
    for text in TEXTS:
        ids = codec.encode(text)
        dec = StreamDecoder(codec)
        pieces = [dec.push(t) for t in ids] + [dec.flush()]
        assert "".join(pieces) == codec.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)


def test_stream_holds_back_split_bytes(tiny_bundle_int8):
    codec = TextCodec(load_bundle(tiny_bundle_int8))
    # byte-level tokens of a 4-byte emoji, one byte per token: nothing may come out before the last
    vocab = codec.tok.get_vocab()

    alphabet = {b: ch for b, ch in zip(range(256), _bytes_to_unicode())}
    byte_ids = [vocab[alphabet[b]] for b in "🙂".encode()]
    dec = StreamDecoder(codec)
    out = [dec.push(t) for t in byte_ids]
    assert out[:3] == ["", "", ""] and out[3] == "🙂"


def test_flush_emits_incomplete_tail(tiny_bundle_int8):
    codec = TextCodec(load_bundle(tiny_bundle_int8))
    vocab = codec.tok.get_vocab()
    alphabet = dict(zip(range(256), _bytes_to_unicode()))
    dec = StreamDecoder(codec)
    dec.push(vocab["a"])
    assert dec.push(vocab[alphabet["🙂".encode()[0]]]) == ""
    assert dec.flush() != ""  # the user sees the broken tail rather than losing it


def _bytes_to_unicode():
    """GPT-2's byte -> printable character map, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    m = dict(zip(bs, cs))
    return [chr(m[b]) for b in range(256)]
