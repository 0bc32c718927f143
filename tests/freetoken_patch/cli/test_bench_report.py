"""`ftpatch bench report`: the page holds every figure of its JSON, its charts plot the JSON's
numbers, it needs no network, and it renders in headless Chromium without script errors and not
blank; the PNG charts; the README's table is what the command makes from docs/results/*.json.

The sample JSON in data/ is made up (its "synthetic_sample" says so); Chromium is optional
locally (the test skips, saying why) and required in CI (FTPATCH_REQUIRE_CHROMIUM=1).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from freetoken_patch.cli import main
from freetoken_patch.report import data as D
from freetoken_patch.report import png

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = [Path(__file__).parent / "data" / n for n in ("bench_sample_caps.json", "bench_sample_trace.json")]


class Tags(HTMLParser):
    """Every start tag with its attributes, and each td's text."""

    def __init__(self):
        super().__init__()
        self.tags, self._td = [], None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "td":
            self._td = self.tags[-1][1]
            self._td["#text"] = ""

    def handle_data(self, text):
        if self._td is not None:
            self._td["#text"] += text

    def handle_endtag(self, tag):
        if tag == "td":
            self._td = None


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "report.html"
    assert main(["bench", "report", *map(str, SAMPLES), "-o", str(out)]) == 0
    html = out.read_text()
    p = Tags()
    p.feed(html)
    return out, html, p.tags


def loaded() -> dict:
    return {p.name: json.loads(p.read_text()) for p in SAMPLES}


def test_the_samples_say_they_are_made_up():
    assert all("not a measurement" in d["synthetic_sample"] for d in loaded().values())


def test_page_holds_every_figure(page):
    _, _, tags = page
    shown = {a["data-src"]: a["#text"] for t, a in tags if t == "td" and "fig" in a.get("class", "")}
    for name, d in loaded().items():
        figs = D.figures(d)
        assert len(figs) > 50
        for ptr, v in figs:
            assert shown.get(f"{name}#{ptr}") == repr(v), f"{name}#{ptr}"


def test_chart_points_are_the_json_numbers(page):
    _, _, tags = page
    data = loaded()
    pts = [a for t, a in tags if "pt" in a.get("class", "").split()]
    for a in pts:
        name, ptr = a["data-src"].split("#", 1)
        want = D.resolve(data[name], ptr) * float(a["data-scale"])
        assert float(a["data-value"]) == pytest.approx(want, rel=1e-12), a["data-src"]
    srcs = {a["data-src"] for a in pts}
    caps, trace = "bench_sample_caps.json", "bench_sample_trace.json"
    want = {f"{trace}#/{t}/median" for t in ("pp512", "pp2048", "tg128")}
    want |= {f"{trace}#/cache/hit_rate", f"{trace}#/cache/pcie_MB_per_token", f"{trace}#/vram/nvidia_smi_peak"}
    for i in range(2):
        want |= {f"{caps}#/runs/{i}/{t}/median" for t in ("pp512", "pp2048", "tg128")}
        want |= {f"{caps}#/llama_bench/runs/{i}/tests/{t}/median" for t in ("pp512", "pp2048", "tg128")}
        want |= {f"{caps}#/runs/{i}/cache/hit_rate", f"{caps}#/llama_bench/runs/{i}/vram_peak"}
    assert want <= srcs, want - srcs
    charts = [a["id"] for t, a in tags if t == "svg"]
    assert charts == ["chart-tg128", "chart-pp512", "chart-pp2048", "chart-hit_rate", "chart-pcie", "chart-vram"]


def test_page_fetches_nothing(page):
    _, html, tags = page
    assert not [a for t, a in tags if t in ("link", "img", "iframe") or (t == "script" and "src" in a)]
    rest = html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert not re.search(r"https?://|url\(|@import", rest)


def test_summary_rows_state_ratios(page):
    _, html, _ = page
    # 8 GiB decode: 150.5 / 50.0 = 3.0x, prefill pp2048: 3000 / 480 = 6.2x (sample numbers)
    assert ">3.0x<" in html and ">6.2x<" in html and "--n-cpu-moe 23 after 2 attempts" in html


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if shutil.which(name):
            return shutil.which(name)
    if os.environ.get("FTPATCH_REQUIRE_CHROMIUM") == "1":
        pytest.fail("FTPATCH_REQUIRE_CHROMIUM=1 but no chromium on PATH (.ci/run installs it)")
    pytest.skip("no chromium on PATH: the page's rendering is checked where it is (CI installs it)")


def test_renders_in_headless_chromium(page, tmp_path):
    browser = _chromium()
    out, _, tags = page
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--hide-scrollbars", "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(flags + ["--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    root = re.search(r"<html[^>]*>", dom.stdout)[0]
    n_points = sum(1 for t, a in tags if "pt" in a.get("class", "").split())
    assert 'data-ready="1"' in root and 'data-mismatch="0"' in root, root
    assert f'data-points="{n_points}"' in root and "data-js-errors" not in root, root
    assert "Uncaught" not in dom.stderr, dom.stderr[-2000:]
    shot = tmp_path / "report.png"
    r = subprocess.run(flags + ["--window-size=1400,1800", f"--screenshot={shot}", out.as_uri()],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    if os.environ.get("FTPATCH_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["FTPATCH_KEEP_SCREENSHOT"])
    # the error hook works: the same page with a broken script says so
    broken = tmp_path / "broken.html"
    broken.write_text(out.read_text().replace("</body>", "<script>no_such_function()</script></body>"))
    dom = subprocess.run(flags + ["--dump-dom", broken.as_uri()], capture_output=True, text=True, timeout=180)
    assert "data-js-errors" in re.search(r"<html[^>]*>", dom.stdout)[0]
    Image = pytest.importorskip("PIL.Image")
    from PIL import ImageStat
    img = Image.open(shot).convert("L")
    assert img.size == (1400, 1800)
    assert ImageStat.Stat(img).stddev[0] > 10                     # not one flat colour
    dark = sum(img.histogram()[:128]) / (img.size[0] * img.size[1])
    assert dark > 0.005                                           # text and lines were drawn


def test_png_charts(tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["bench", "report", *map(str, SAMPLES), "--png", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == sorted(["tg128.png", "pp512.png", "pp2048.png", "hit_rate.png", "pcie.png",
                            "vram.png", "summary.png"])
    from PIL import Image, ImageStat
    for n in names:
        assert ImageStat.Stat(Image.open(tmp_path / n).convert("L")).stddev[0] > 5, n


def test_png_without_matplotlib_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(png, "available", lambda: False)
    out = tmp_path / "r.html"
    assert main(["bench", "report", str(SAMPLES[0]), "-o", str(out), "--png", str(tmp_path / "png")]) == 1
    assert out.exists() and not (tmp_path / "png").exists()
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("--png")]
    assert len(said) == 1 and "pip install 'ftpatch[report]'" in said[0]


def test_without_outputs_the_table_is_printed(capsys):
    assert main(["bench", "report", *map(str, SAMPLES)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| cap |") and "| 8 GiB | 150.5 | 50.0 | 3.0x | 190.0 |" in out


def test_report_errors_are_one_line(tmp_path, capsys):
    assert main(["bench", "report", str(tmp_path / "none.json")]) == 1
    assert main(["bench", str(SAMPLES[0]), str(SAMPLES[1])]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "cannot read" in err[0] and "bench report" in err[1]


DOCS_COMMAND = ("ftpatch bench report docs/results/*.json --expect docs/results/expect/rows.json "
                "--markdown README.md --markdown docs/BENCHMARKS.md --png docs/results/charts")


def test_readme_and_benchmarks_tables_are_made_from_committed_json(tmp_path, monkeypatch):
    """README's and BENCHMARKS' tables are what the command under them makes from the committed
    JSON: the same files for both, so the two documents cannot disagree."""
    results = sorted((ROOT / "docs" / "results").glob("*.json"))
    assert results, "docs/results/*.json: the documents' tables are made from these"
    for p in results:
        d = json.loads(p.read_text())
        assert d.get("source") or d.get("run"), f"{p.name}: say where its figures come from"
    for doc in ("README.md", "docs/BENCHMARKS.md"):
        text = (ROOT / doc).read_text()
        for name in ("results", "expect"):
            assert f"<!-- {name}:begin -->" in text, f"{doc} lacks the {name} table"
        assert f"Made by `{DOCS_COMMAND}`" in text, f"{doc} names another command"
    # the documents and the results in a scratch tree, the command run there as written
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    monkeypatch.chdir(tmp_path)
    rel = [str(p.relative_to(ROOT)) for p in results]
    assert main(["bench", "report", *rel, "--expect", "docs/results/expect/rows.json",
                 "--markdown", "README.md", "--markdown", "docs/BENCHMARKS.md",
                 "--markdown-image", "docs/results/charts/summary.png"]) == 0
    for doc in ("README.md", "docs/BENCHMARKS.md"):
        assert (tmp_path / doc).read_text() == (ROOT / doc).read_text(), \
            f"{doc}'s tables differ from what `{DOCS_COMMAND}` makes: run it"


def test_expect_rows_are_measured_or_say_not_yet(tmp_path):
    """A row without a result file reads 'not measured yet' beside its command; a row's result
    fills decode and prefill from its JSON."""
    from freetoken_patch.report import markdown
    spec = {"kind": "ftpatch-expect", "rows": [
        {"setup": "a", "machine": "m", "model": "x", "command": "ftpatch bench x --device cpu",
         "result": None},
        {"setup": "b", "machine": "m", "model": "x", "command": "ftpatch bench x --vram 8GiB",
         "result": "r.json"}]}
    (tmp_path / "rows.json").write_text(json.dumps(spec))
    shutil.copy(SAMPLES[1], tmp_path / "r.json")
    table = markdown.expect_table(markdown.load_expect(str(tmp_path / "rows.json")))
    first, second = table.splitlines()[2:]
    assert "not measured yet | not measured yet" in first and "`ftpatch bench x --device cpu`" in first
    tg = json.loads(SAMPLES[1].read_text())["tg128"]["median"]
    assert f"tg128 {tg:,.1f}" in second
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "other"}))
    with pytest.raises(ValueError, match="not an expectations file"):
        markdown.load_expect(str(tmp_path / "bad.json"))


def test_nan_in_a_result_does_not_break_the_page(tmp_path):
    d = json.loads(SAMPLES[1].read_text())
    d["cache"]["prefetch_precision"] = float("nan")
    d["tg128"]["max"] = float("inf")
    bad = tmp_path / "nan.json"
    bad.write_text(json.dumps(d))
    out = tmp_path / "nan.html"
    assert main(["bench", "report", str(bad), "-o", str(out)]) == 0
    html = out.read_text()
    blob = re.search(r'<script type="application/json"[^>]*>(.*?)</script>', html, re.S)[1]

    def refuse(c):
        raise ValueError(c)
    assert json.loads(blob, parse_constant=refuse)["cache"]["prefetch_precision"] is None
    assert "nan" not in re.findall(r'data-value="([^"]*)"', html)
