"""core/signing.py: the signatures of reasoning handed back (issue 33), and the key file beside the store."""

from __future__ import annotations

import base64
import threading

import pytest

from ringserve.core.signing import ReasoningSigner, new_key
from ringserve.server import SIGNING_KEY_FILE, signing_key
from ringserve.store.sqlite import StoreError

KEY = new_key()


def test_a_signature_restores_its_own_text_only():
    signer = ReasoningSigner.from_text(KEY)
    signature = signer.sign("first, look at the file")
    assert signer.restore("first, look at the file", signature) == "first, look at the file"
    assert signer.restore("first, look at the other file", signature) is None  # edited text
    assert signer.restore("", signature) is None  # a plain signature does not carry the text
    assert ReasoningSigner.from_text(new_key()).restore("first, look at the file", signature) is None  # another key


def test_a_sealed_signature_carries_its_text():
    signer = ReasoningSigner.from_text(KEY)
    sealed = signer.seal("Grüße 👋🏽 and a plan")
    assert signer.restore("", sealed) == "Grüße 👋🏽 and a plan"  # display "omitted": sent back without text
    assert signer.restore("Grüße 👋🏽 and a plan", sealed) == "Grüße 👋🏽 and a plan"
    assert signer.restore("something else", sealed) is None
    mac, _, text = sealed.partition(".")
    forged = base64.urlsafe_b64encode(b"another plan").rstrip(b"=").decode()
    assert signer.restore("", f"{mac}.{forged}") is None


@pytest.mark.parametrize("signature", ["", ".", "!!!", "a.b.c", "EqQ", "real Claude's: " + "x" * 300,
                                       "ErUBCkYIBBgCIkB" + "A" * 200])
def test_foreign_and_malformed_signatures_do_not_verify(signature):
    assert ReasoningSigner.from_text(KEY).restore("thinking", signature) is None
    assert ReasoningSigner.from_text(KEY).restore("", signature) is None


def test_keys_are_base64_of_32_bytes_or_more():
    raw = bytes(range(32))
    for text in (base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode().rstrip("=")):
        assert ReasoningSigner.from_text(text).key == raw
    for bad in ("", "short", base64.b64encode(bytes(31)).decode(), "not base64 at all!"):
        with pytest.raises(ValueError):
            ReasoningSigner.from_text(bad)
    assert "key" not in repr(ReasoningSigner.from_text(KEY)).replace("ReasoningSigner", "")


def test_the_key_file_is_made_once_beside_the_store_and_kept(tmp_path):
    store = str(tmp_path / "messages.sqlite3")
    first = signing_key("", store)
    assert (tmp_path / SIGNING_KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert signing_key("", store) == first  # a restart signs with the same key
    assert list(tmp_path.iterdir()) == [tmp_path / SIGNING_KEY_FILE]
    assert signing_key(KEY, store) == KEY  # [server] signing_key wins
    assert signing_key("", ":memory:") != signing_key("", ":memory:")  # a store in memory: a key per process


def test_processes_starting_together_agree_on_one_key(tmp_path):
    store = str(tmp_path / "messages.sqlite3")
    keys: list[str] = []
    threads = [threading.Thread(target=lambda: keys.append(signing_key("", store))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 1 and len(keys) == 8
    assert [p.name for p in tmp_path.iterdir()] == [SIGNING_KEY_FILE]


def test_a_bad_key_file_is_one_line_naming_it(tmp_path):
    (tmp_path / SIGNING_KEY_FILE).write_text("nonsense\n")
    with pytest.raises(StoreError, match=SIGNING_KEY_FILE):
        signing_key("", str(tmp_path / "messages.sqlite3"))
    with pytest.raises(StoreError, match="signing key"):
        signing_key("", str(tmp_path / "missing" / "messages.sqlite3"))
