"""``swarm-relay`` that also writes down every byte it forwards: ``python -m tests.netlab.recording_relay
--record DIR <swarm-relay options>``. Each spliced connection gets two files in DIR,
``<connection id>.to_agent`` and ``<connection id>.to_peer``, holding exactly what the relay passed
on, so a test can check that it carried TLS records and nothing else (``tls_records``)."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

from worker_agent.agent.relay import Direction, Relay, main

TLS_CONTENT_TYPES = frozenset({20, 21, 22, 23})  # change_cipher_spec, alert, handshake, application_data


class RecordingRelay(Relay):
    def __init__(self, record: Path, **options) -> None:
        super().__init__(**options)
        self.record = record

    def forward(self, connection: str, direction: Direction, data: bytes) -> bytes:
        with (self.record / f"{connection}.{direction.value}").open("ab") as file:
            file.write(data)
        return data


def tls_records(stream: bytes) -> list[tuple[int, int]]:
    """(content type, length) of every TLS record in ``stream``; raises ValueError at the first
    byte that does not start a record, or when the stream ends inside one."""
    records, at = [], 0
    while at < len(stream):
        header = stream[at : at + 5]
        if len(header) < 5 or header[0] not in TLS_CONTENT_TYPES or header[1] != 3 or header[2] not in (1, 3):
            raise ValueError(f"not a TLS record header at byte {at}: {header.hex()}")
        length = int.from_bytes(header[3:5], "big")
        if at + 5 + length > len(stream):
            raise ValueError(f"the stream ends inside a {length}-byte record at byte {at}")
        records.append((header[0], length))
        at += 5 + length
    return records


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", type=Path, required=True)
    args, rest = parser.parse_known_args(argv)
    args.record.mkdir(parents=True, exist_ok=True)
    return main(rest, relay_class=partial(RecordingRelay, args.record))


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
