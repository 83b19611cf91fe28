"""h2spec's JUnit report (tests/support/h2spec.py) is read even when h2spec wrote a frame's raw
payload into it: NULs and invalid UTF-8 in a PING's opaque data, as seen under load."""

from __future__ import annotations

from pathlib import Path

from tests.support.h2spec import parse_junit

REPORT = (b'<?xml version="1.0" encoding="UTF-8"?>\n<testsuites>\n'
          b'  <testsuite name="7. Error Codes" package="http2/7" id="7" tests="1" errors="1">\n'
          b'    <testcase package="http2/7" classname="Sends a RST_STREAM frame with unknown error code">\n'
          b'      <error>PING Frame (length:8, flags:0x01, stream_id:0, opaque_data:\x00\x00\x00\x00\x00\x00\x00\x00)\n'
          b'PING Frame ((length:8, flags:0x00, stream_id:0, opaque_data:\xc1\xe4\x83\xb3+\xd9J:)</error>\n'
          b'    </testcase>\n  </testsuite>\n</testsuites>\n')


def test_raw_frame_bytes_in_the_report_are_escaped_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "h2spec.xml"
    path.write_bytes(REPORT)
    report = parse_junit(path)
    failure = report.failed["http2/7 Sends a RST_STREAM frame with unknown error code"]
    assert failure.expected == ("PING Frame (length:8, flags:0x01, stream_id:0, opaque_data:" + "\\x00" * 8 + ")",)
    assert failure.actual.startswith("PING Frame ((length:8, flags:0x00, stream_id:0, opaque_data:\\xc1")
