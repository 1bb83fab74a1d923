"""The browser check of `gndpo report` can fail: a page whose figure does not decode, or whose script
errs, shows up as console messages (the report itself is checked on the demo run in test_e2e)."""

import base64

from tests.conftest import ARTIFACTS, open_in_chromium


def test_the_browser_check_sees_a_broken_figure(tmp_path):
    from gndpo.apps.report import PAGE

    broken = base64.b64encode(b"\x89PNG\r\n\x1a\nnot really a png" * 50).decode()
    page = PAGE.format(title="t", subtitle="", figures=f'<img alt="accuracy" src="data:image/png;base64,{broken}">',
                       table="", tokens="", phases="", phase_note="", configs="<pre>" + "x\n" * 400 + "</pre>")
    (tmp_path / "report.html").write_text(page)
    console = open_in_chromium(tmp_path / "report.html", ARTIFACTS / "broken-report.png")
    assert len(console) == 1 and "figure failed to load: accuracy" in console[0]
