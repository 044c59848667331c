import hashlib
import os
import stat

import pytest
from nacl.signing import SigningKey

from worker_agent.errors import SwarmError
from worker_agent.protocol.keys import (
    KeyFileError,
    generate_signing_key,
    load_signing_key,
    load_verify_key,
    node_id,
    public_key_bytes,
    write_key,
)

pytestmark = pytest.mark.dataplane

SEED = bytes(range(32))


@pytest.fixture
def key() -> SigningKey:
    return SigningKey(SEED)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_generate_signing_key_returns_distinct_keys():
    first, second = generate_signing_key(), generate_signing_key()

    assert len(bytes(first)) == 32
    assert bytes(first) != bytes(second)


def test_write_key_writes_hex_seed_0600_and_hex_public_key_0644(tmp_path, key):
    path = write_key(tmp_path / "node.key", key)

    assert path == tmp_path / "node.key"
    assert path.read_text() == SEED.hex() + "\n"
    assert _mode(path) == 0o600
    pub = tmp_path / "node.key.pub"
    assert pub.read_text() == bytes(key.verify_key).hex() + "\n"
    assert _mode(pub) == 0o644


def test_write_key_sets_exact_modes_whatever_the_umask(tmp_path, key):
    old = os.umask(0o077)
    try:
        write_key(tmp_path / "node.key", key)
    finally:
        os.umask(old)

    assert _mode(tmp_path / "node.key") == 0o600
    assert _mode(tmp_path / "node.key.pub") == 0o644


def test_write_key_refuses_to_overwrite_an_existing_key(tmp_path, key):
    path = tmp_path / "node.key"
    path.write_text("precious\n")

    with pytest.raises(FileExistsError, match="already exists; refusing to overwrite a key"):
        write_key(path, key)

    assert path.read_text() == "precious\n"
    assert not (tmp_path / "node.key.pub").exists()


def test_write_key_refuses_when_only_the_public_key_exists(tmp_path, key):
    (tmp_path / "node.key.pub").write_text("old\n")

    with pytest.raises(FileExistsError, match=r"node\.key\.pub already exists"):
        write_key(tmp_path / "node.key", key)

    assert not (tmp_path / "node.key").exists()
    assert (tmp_path / "node.key.pub").read_text() == "old\n"


def test_write_key_with_force_replaces_the_key_and_tightens_its_mode(tmp_path, key):
    path = tmp_path / "node.key"
    path.write_text("old\n")
    path.chmod(0o666)

    write_key(path, key, force=True)

    assert path.read_text() == SEED.hex() + "\n"
    assert _mode(path) == 0o600
    assert (tmp_path / "node.key.pub").read_text() == bytes(key.verify_key).hex() + "\n"


def test_load_signing_key_round_trips_a_written_key(tmp_path, key):
    write_key(tmp_path / "node.key", key)

    loaded = load_signing_key(str(tmp_path / "node.key"))

    assert bytes(loaded) == SEED


def test_load_signing_key_names_a_missing_path(tmp_path):
    path = tmp_path / "absent.key"

    with pytest.raises(KeyFileError) as err:
        load_signing_key(path)

    assert str(err.value) == f"private key file {path} does not exist"
    assert err.value.code == "key_file"
    assert isinstance(err.value, ValueError)
    assert isinstance(err.value, SwarmError)


@pytest.mark.parametrize(
    "content",
    ["", "zz" * 32 + "\n", SEED.hex()[:-2] + "\n", SEED.hex() + "00\n", " ".join(["ab"] * 21) + " a\n"],
    ids=["empty", "not-hex", "short", "long", "spaced"],
)
def test_load_signing_key_rejects_a_malformed_file(tmp_path, content):
    path = tmp_path / "bad.key"
    path.write_text(content)

    with pytest.raises(KeyFileError) as err:
        load_signing_key(path)

    assert str(err.value) == f"private key file {path} does not hold 64 hex characters"


def test_load_signing_key_rejects_a_non_ascii_file(tmp_path):
    path = tmp_path / "bad.key"
    path.write_bytes(b"\xff" * 64)

    with pytest.raises(KeyFileError, match=f"cannot read private key file {path}"):
        load_signing_key(path)


def test_load_verify_key_accepts_a_hex_string(key):
    assert load_verify_key(bytes(key.verify_key).hex()) == bytes(key.verify_key)


def test_load_verify_key_accepts_upper_case_hex_with_surrounding_space(key):
    assert load_verify_key(" " + bytes(key.verify_key).hex().upper() + "\n") == bytes(key.verify_key)


def test_load_verify_key_reads_a_pub_file(tmp_path, key):
    write_key(tmp_path / "node.key", key)

    assert load_verify_key(str(tmp_path / "node.key.pub")) == bytes(key.verify_key)


def test_load_verify_key_derives_the_public_key_from_a_private_key_file(tmp_path, key):
    write_key(tmp_path / "node.key", key)

    assert load_verify_key(str(tmp_path / "node.key")) == bytes(key.verify_key)


def test_load_verify_key_names_a_missing_pub_file(tmp_path):
    path = tmp_path / "absent.pub"

    with pytest.raises(KeyFileError) as err:
        load_verify_key(str(path))

    assert str(err.value) == f"public key file {path} does not exist"


def test_load_verify_key_rejects_a_short_hex_string_as_a_missing_file():
    with pytest.raises(KeyFileError) as err:
        load_verify_key("abcd")

    assert str(err.value) == "private key file abcd does not exist"


def test_public_key_bytes_returns_the_raw_verify_key(key):
    assert public_key_bytes(key) == bytes(key.verify_key)
    assert len(public_key_bytes(key)) == 32


def test_node_id_is_node_dash_sixteen_hex_of_sha256():
    public = bytes(32)

    assert node_id(public) == "node-" + hashlib.sha256(public).hexdigest()[:16]
    assert node_id(public) == "node-66687aadf862bd77"


def test_node_id_rejects_a_key_of_the_wrong_length():
    with pytest.raises(KeyFileError, match="a public key is 32 bytes"):
        node_id(b"short")
