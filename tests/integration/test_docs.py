"""The documentation a user reads: README.md a front page (<= 300 lines) whose long topics live in
docs/*.md, every relative link and anchor in them resolving, and no reference to files or
discussions outside the repository."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"BACKGROUND\.md|STYLE\.md|\.\./shared|\bissue \d+|\bseed 000|seed document",
                     re.I)


def _read(page: str) -> str:
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    return f.read()


def _anchors(page: str) -> set[str]:
  """GitHub's heading ids: lower case, punctuation but - and _ dropped, spaces to -."""
  out, fence = set(), False
  for line in _read(page).splitlines():
    fence ^= line.startswith("```")
    m = None if fence else re.match(r"^#{1,6} (.*)$", line)
    if m:
      out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
  return out


def test_readme_is_a_front_page():
  text = _read("README.md")
  assert len(text.splitlines()) <= 300, "README.md: move long topics to a docs/ page"
  first_block = text[text.index("```"):].split("```")[1]
  assert "make demo" in first_block and "make test" in first_block
  for page in PAGES[1:]:
    assert f"({page})" in text or f"({page}#" in text, f"README.md does not link {page}"


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
  bad = []
  for target in LINK.findall(_read(page)):
    if re.match(r"^[a-z]+:", target):  # https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else (
        os.path.join(ROOT, page))
    if not os.path.exists(resolved):
      bad.append(f"{target}: no such file")
    elif anchor and resolved.endswith(".md") and anchor not in _anchors(
        os.path.relpath(resolved, ROOT)):
      bad.append(f"{target}: no such heading")
  assert not bad, f"{page}: {bad}"


@pytest.mark.parametrize("page", PAGES)
def test_no_references_outside_the_repository(page):
  found = [m.group(0) for m in OUTSIDE.finditer(_read(page))]
  assert not found, f"{page} cites {found}"


def test_generated_tables_match_their_jsons(tmp_path):
  """Tables between `<!-- tpu_tables ... -->` markers are experiments/tpu_tables.py's output for
  the JSONs the marker names: a figure edited by hand, or a JSON written again, shows here."""
  spec = importlib.util.spec_from_file_location(
      "tpu_tables", os.path.join(ROOT, "experiments", "tpu_tables.py"))
  tables = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tables)
  stale = [page for page in PAGES if not tables.update(page, check=True)]
  assert not stale, f"run: python experiments/tpu_tables.py --update {' '.join(stale)}"
  page = tmp_path / "page.md"  # and the check sees a stale block, which --update rewrites
  page.write_text("x\n<!-- tpu_tables --decode experiments/results/aot_decode_v5e_tiny.json -->\n"
                  "| tiny | 1 | 16 | 9.9 |\n<!-- /tpu_tables -->\n")
  assert not tables.update(str(page), check=True)
  assert tables.update(str(page), check=False) is False and tables.update(str(page), check=True)
  assert "| tiny | 1 | 16 | 3.6 | 7.3 | 2.02 | 2.98 | 1.47 |" in page.read_text()
