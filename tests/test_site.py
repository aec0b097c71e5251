"""The built course, checked in a real browser (Debian's headless Chromium).

`make book` writes the site to `_build/html`; this test serves it on 127.0.0.1 and visits every page of `_toc.yml`
and every internal page they link to. It fails on a missing page, a broken internal link or anchor, an error or
traceback in a page, an image that does not load, a formula MathJax did not typeset, `#|` directive text in a code cell, a Colab button that does
not open the chapter's own notebook, a table or text output wider than the content column of a 1280-pixel window, and a figure shown at
less than half its natural width. It also saves screenshots of the home page and of one chapter to
`_build/screenshots/`.

How images are checked: an image "loads" when the browser decoded it, i.e. its `naturalWidth` is positive. Headless
Chromium's `--dump-dom` prints the DOM after the page has run, but not image sizes, so the test server appends a
small script to every HTML page it serves; after the `load` event it makes every image eager, waits for each to
load or fail, copies `naturalWidth` into a `data-natural-width` attribute and marks `<body data-probe="done">`.
The dumped DOM then carries what the browser saw. Every image URL is also fetched over HTTP and must answer 200.
"""
import configparser
import http.server
import re
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.error import HTTPError
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit
from urllib.request import urlopen

import pytest
from bs4 import BeautifulSoup

ROOT = Path(__file__).parents[1]
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
_settings = configparser.ConfigParser(); _settings.read(ROOT / "settings.ini")
COLAB = f"https://colab.research.google.com/github/{_settings['DEFAULT']['git_url'].split('github.com/')[1].rstrip('/')}/blob/main/"  # from settings.ini
NOT_BUILT = f"{HTML.relative_to(ROOT)} does not exist: run `make book` first (CI builds the book before this test)"
NO_BROWSER = "Chromium is not installed: run `make browser` (apt-get install -y chromium)"

# The browser must not wait on the network: every host but the test server fails at once (CDN scripts included).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                  "--virtual-time-budget=15000", "--window-size=1280,2000"]  # a laptop's browser window

PROBE = b"""<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  images.forEach(img => { img.loading = "eager"; });
  Promise.all(images.map(img => img.complete ? null : new Promise(done => {
    img.addEventListener("load", done); img.addEventListener("error", done); }))).then(() => {
    images.forEach(img => { img.setAttribute("data-natural-width", img.naturalWidth); img.setAttribute("data-shown-width", img.clientWidth); });
    const column = document.querySelector("main article") || document.querySelector("main") || document.body;
    document.querySelectorAll("div.cell_output table, div.cell_output pre").forEach(el => {
      if (el.scrollWidth > column.clientWidth + 2) el.setAttribute("data-too-wide", el.scrollWidth + " > " + column.clientWidth);
    });
    document.body.setAttribute("data-probe", "done");
  });
});
</script>"""


from toc import TOC_FILES


class Handler(http.server.SimpleHTTPRequestHandler):
    "Serves `_build/html`, with the image probe appended to every HTML page."
    def __init__(self, *args, **kwargs): super().__init__(*args, directory=str(HTML), **kwargs)

    def log_message(self, *args): pass

    def do_GET(self):
        path = Path(self.translate_path(self.path))
        if path.is_dir() and self.path.split("?")[0].endswith("/"): path = path / "index.html"
        if path.suffix != ".html" or not path.is_file(): return super().do_GET()
        body = path.read_bytes()
        body = body.replace(b"</body>", PROBE + b"</body>", 1) if b"</body>" in body else body + PROBE
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def fetch(url):
    "(HTTP status, body or None, content type) of `url`."
    try:
        with urlopen(url, timeout=30) as r: return r.status, r.read(), r.headers.get_content_type()
    except HTTPError as e: return e.code, None, ""


def chromium(*args):
    "Run headless Chromium with a throw-away profile; its stdout."
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([shutil.which("chromium"), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                             capture_output=True, text=True, timeout=120)
    return out.stdout


def page_name(url, base): return urlsplit(url).path.removeprefix(urlsplit(base).path).lstrip("/") or "index.html"


def refs(soup):
    "(kind, reference) of every link, image, stylesheet and script in a page."
    for tag, attr in (("a", "href"), ("img", "src"), ("link", "href"), ("script", "src")):
        for el in soup.find_all(tag, attrs={attr: True}): yield tag, el[attr]


class Site:
    "The crawl of the served site: pages, their statuses, rendered DOMs, and the problems found in each category."
    def __init__(self, base):
        self.base, self.status, self.raw, self.dom = base, {}, {}, {}
        self.problems = {k: [] for k in ("missing", "links", "anchors", "errors", "images", "math", "directives", "colab", "render", "wide", "small")}
        self.toc_pages = [f"{base}/{f}.html" for f in TOC_FILES]
        self.crawl()
        self.render()
        self.check()

    def internal(self, url): return urlsplit(url).netloc == urlsplit(self.base).netloc

    def visit(self, url):
        "Fetch `url` once; keep HTML pages' parsed source."
        if url in self.status: return
        self.status[url], body, ctype = fetch(url)
        if self.status[url] == 200 and ctype == "text/html": self.raw[url] = BeautifulSoup(body, "html.parser")

    def crawl(self):
        "Every page of the toc, and every internal page or resource they reference, transitively for pages."
        queue, self.links = list(self.toc_pages), []
        while queue:
            url = queue.pop(0)
            self.visit(url)
            for kind, ref in refs(self.raw.get(url, BeautifulSoup("", "html.parser"))):
                self.follow(url, kind, ref, queue)

    def follow(self, page, kind, ref, queue):
        "Record an internal reference of `page` and fetch its target; a linked page joins `queue` when one is given."
        if ref.startswith(("mailto:", "javascript:", "data:", "tel:")): return
        parts = urlsplit(urljoin(page, ref))
        resource = urlunsplit(parts._replace(query="", fragment=""))
        if not self.internal(resource): return
        self.links.append((page, kind, resource, unquote(parts.fragment)))
        if kind == "a" and resource not in self.status and queue is not None: queue.append(resource)
        self.visit(resource)

    def is_redirect(self, url):
        return bool(self.raw[url].find("meta", attrs={"http-equiv": re.compile("refresh", re.I)}))

    def render(self):
        "Each HTML page as the browser leaves it; links found only in the rendered DOM are checked too."
        pages = [u for u in self.raw if not self.is_redirect(u)]
        with ThreadPoolExecutor(max_workers=3) as pool:
            for url, dom in zip(pages, pool.map(lambda u: chromium("--dump-dom", u), pages)):
                self.dom[url] = BeautifulSoup(dom, "html.parser")
        for url, dom in self.dom.items():
            for kind, ref in refs(dom): self.follow(url, kind, ref, None)

    def check(self):
        p = self.problems
        for url in self.toc_pages:
            if self.status.get(url) != 200: p["missing"].append(f"{page_name(url, self.base)}: HTTP {self.status.get(url)}")
        for page, kind, target, fragment in dict.fromkeys(self.links):
            where = f"{page_name(page, self.base)} -> <{kind}> {page_name(target, self.base)}"
            if self.status.get(target) != 200: p["links"].append(f"{where}: HTTP {self.status.get(target)}")
            elif kind == "a" and fragment and target in self.raw and not self.has_anchor(target, fragment):
                p["anchors"].append(f"{where}#{fragment}: no element with this id")
        for url, dom in self.dom.items(): self.check_page(url, dom)

    def has_anchor(self, url, fragment):
        return any(s.find(id=fragment) or s.find(attrs={"name": fragment}) for s in (self.raw[url], self.dom.get(url)) if s)

    def check_page(self, url, dom):
        p, name = self.problems, page_name(url, self.base)
        if dom.body is None or dom.body.get("data-probe") != "done":
            p["render"].append(f"{name}: the browser did not finish loading the page"); return
        for el in dom.select(".output.traceback, .output.error"):
            p["errors"].append(f"{name}: error output: {el.get_text()[:300]!r}")
        for el in dom.select(".output.stderr"):
            if re.search(r"\w*(Error|Exception)\b", el.get_text()): p["errors"].append(f"{name}: stderr: {el.get_text()[:300]!r}")
        if "Traceback (most recent call last)" in dom.get_text():
            p["errors"].append(f"{name}: a Python traceback is shown")
        for img in dom.find_all("img"):
            src = urljoin(url, img.get("src", ""))
            if not self.internal(src) and not src.startswith("data:"): continue  # offline: the test cannot load other hosts
            natural, shown = float(img.get("data-natural-width") or 0), float(img.get("data-shown-width") or 0)
            if not natural > 0:
                p["images"].append(f"{name}: image not rendered: {img.get('src', '')[:120]}")
            elif "_images/" in img.get("src", "") and shown < natural / 2:
                p["small"].append(f"{name}: figure shown {shown:.0f} px wide, under half its {natural:.0f} px: {img.get('src', '')[:80]}")
        for el in dom.select("[data-too-wide]"):
            p["wide"].append(f"{name}: {el.name} output wider than the column ({el['data-too-wide']} px): {el.get_text(' ', strip=True)[:80]!r}")
        formulas = dom.select(".math")
        raw = [m for m in formulas if not m.find("mjx-container")]
        if raw: p["math"].append(f"{name}: {len(raw)} of {len(formulas)} formulas not typeset, e.g. {raw[0].get_text()[:80]!r}")
        for cell in dom.select(".cell_input"):
            for line in cell.get_text().splitlines():
                if line.lstrip().startswith("#|"): p["directives"].append(f"{name}: {line.strip()!r}")
        if url in self.toc_pages:
            expected = COLAB + f"{name.removesuffix('.html')}.ipynb"
            colab = {a["href"] for a in dom.find_all("a", href=True) if "colab.research.google.com" in a["href"]}
            if colab != {expected}: p["colab"].append(f"{name}: Colab links {sorted(colab)}, expected {expected}")


@pytest.fixture(scope="module")
def site():
    if not HTML.is_dir(): pytest.fail(NOT_BUILT)
    if not shutil.which("chromium"): pytest.fail(NO_BROWSER)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try: yield Site(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown(); server.server_close(); thread.join()


def test_book_is_built():
    assert HTML.is_dir(), NOT_BUILT


def report(problems): return "\n".join(problems[:50]) + (f"\n... and {len(problems) - 50} more" if len(problems) > 50 else "")


def test_every_toc_page_exists(site): assert not site.problems["missing"], report(site.problems["missing"])


def test_every_page_loads_in_the_browser(site): assert not site.problems["render"], report(site.problems["render"])


def test_internal_links_resolve(site): assert not site.problems["links"], report(site.problems["links"])


def test_internal_anchors_exist(site): assert not site.problems["anchors"], report(site.problems["anchors"])


def test_no_errors_in_pages(site): assert not site.problems["errors"], report(site.problems["errors"])


def test_images_load(site):
    assert any(d.find("img", src=re.compile("_images/")) for d in site.dom.values()), "no figure found anywhere in the book"
    assert not site.problems["images"], report(site.problems["images"])


def test_math_is_typeset(site):
    "MathJax is served with the site (sphinx-mathjax-offline), so formulas render without any network."
    assert not site.problems["math"], report(site.problems["math"])


def test_no_directive_text(site): assert not site.problems["directives"], report(site.problems["directives"])


def test_outputs_fit_the_column(site):
    "No table or text output is wider than the page's content column (1280-pixel window)."
    assert not site.problems["wide"], report(site.problems["wide"])


def test_figures_are_legible(site):
    "No figure is shrunk below half its natural width: it would be too small to read."
    assert not site.problems["small"], report(site.problems["small"])


def test_colab_buttons_open_the_chapter(site): assert not site.problems["colab"], report(site.problems["colab"])


def test_screenshots(site):
    "The home page and the chapter with the most figures, as a 1280-pixel-wide browser shows them."
    SHOTS.mkdir(parents=True, exist_ok=True)
    figures = {u: len(site.dom[u].select("img[src*='_images/']")) for u in site.toc_pages if u in site.dom}
    chapter = max((u for u in figures if not u.endswith("nbs/index.html")), key=lambda u: figures[u])
    for url in (f"{site.base}/nbs/index.html", chapter):
        shot = SHOTS / f"{Path(page_name(url, site.base)).stem}.png"
        shot.unlink(missing_ok=True)
        chromium(f"--screenshot={shot}", "--window-size=1280,2000", url)
        assert shot.is_file() and shot.stat().st_size > 20_000, f"no usable screenshot of {page_name(url, site.base)}"


OUTPUT_PROBLEMS = {  # what no output of the rendered book may show: name -> pattern
    "a progress bar": re.compile(r"\d+%\|[^|\n]*\||\[\d+:\d+<\d+:\d+|\d+(?:\.\d+)?(?:it|s)/(?:s|it)\]"),
    "a Python warning": re.compile(r"\b\w*Warning: "),
    "a machine path": re.compile(r"/tmp/|/root/|/home/|/work/|\.venv/|site-packages"),
    "a traceback": re.compile(r"Traceback \(most recent call last\)"),
    "a claim that failed unchecked": re.compile(r"a sentence of this chapter does not hold"),  # claim() on real caches only
}


def output_problems(html):
    "What the cell outputs of the built book at `html` show that a reader should not see, one line each."
    found = []
    for f in TOC_FILES:
        for out in BeautifulSoup((html / f"{f}.html").read_text(), "html.parser").select("div.cell_output"):
            text = out.get_text()
            found += [f"{f}: {what}: {m.group(0)!r}" for what, p in OUTPUT_PROBLEMS.items() for m in [p.search(text)] if m]
    return found


def test_outputs_show_no_progress_bar_warning_path_or_traceback():
    "Progress bars stay for people running the code; the rendered book shows none, nor warnings, machine paths or tracebacks."
    if not HTML.is_dir(): pytest.fail(NOT_BUILT)
    found = output_problems(HTML)
    assert not found, report(found)
