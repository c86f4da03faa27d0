"""The documentation builds with every warning an error, and the README's links into it resolve.

Sphinx (``sphinx-build -W``) fails on a broken link or cross-reference between pages, a page missing from the
toctree, a missing image and a malformed docstring in the API reference. The README is not part of the site
(GitHub renders it), so its relative links are checked here, anchors included, with GitHub's heading slugs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / 'docs'


def test_docs_build_without_warnings(tmp_path):
    cmd = [
        sys.executable,
        '-m',
        'sphinx',
        '-W',
        '--keep-going',
        '-q',
        '-b',
        'html',
        '-d',
        str(tmp_path / 'doctrees'),
        str(DOCS),
        str(tmp_path / 'html'),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, f'sphinx-build failed:\n{done.stdout}\n{done.stderr}'
    assert (tmp_path / 'html' / 'api.html').read_text().count('UnevenJoin') > 5  # autodoc found the docstrings


def github_slug(heading: str) -> str:
    """The anchor GitHub (and MyST's ``myst_heading_anchors``) gives a Markdown heading."""
    text = re.sub(r'[`*_\[\]()]', '', heading.strip().lower())
    return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def headings(path: Path) -> set[str]:
    text = re.sub(r'```.*?```', '', path.read_text(), flags=re.S)  # no headings inside code blocks
    return {github_slug(m) for m in re.findall(r'^#+ (.+)$', text, flags=re.M)}


def test_github_slug():
    assert github_slug('FSDP (FSDP1 and FSDP2)') == 'fsdp-fsdp1-and-fsdp2'
    assert github_slug('Microbatching and `DDPSyncStrategy`') == 'microbatching-and-ddpsyncstrategy'


def test_readme_links_resolve():
    readme = (ROOT / 'README.md').read_text()
    links = re.findall(r'\]\(([^)#\s]+\.(?:md|png|py|yaml|toml))(#[^)\s]*)?\)', readme)
    assert any(target.startswith('docs/') for target, _ in links), 'the README links into docs/'
    for target, anchor in links:
        if target.startswith(('http://', 'https://')):
            continue
        path = ROOT / target
        assert path.exists(), f'README links to {target}, which does not exist'
        if anchor:
            assert anchor[1:] in headings(path), f'README links to {target}{anchor}: no such heading'
    assert len(readme.splitlines()) <= 150, 'the README stays short: put details into docs/'
