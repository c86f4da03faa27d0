"""Sphinx configuration: furo theme, MyST Markdown pages, API reference from the docstrings (autodoc + napoleon).

Builds offline: no intersphinx, no remote images. ``make docs`` (and ``tests/test_docs.py``) build with ``-W``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # this checkout's composer_join, also without an install

import composer_join

project = 'composer-join'
author = 'composer-join authors'
copyright = '2026, composer-join authors'
release = version = composer_join.__version__

extensions = [
    'myst_parser',
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',  # Google-style "Args:", "Example:" sections, as in Composer's docstrings
    'sphinx.ext.viewcode',
]
source_suffix = {'.md': 'markdown', '.rst': 'restructuredtext'}
exclude_patterns = ['_build']
root_doc = 'index'

myst_enable_extensions = ['colon_fence', 'deflist']
myst_heading_anchors = 3  # [text](page.md#a-heading) links, as GitHub renders them

autodoc_member_order = 'bysource'
autodoc_typehints = 'description'
autodoc_default_options = {'members': True, 'show-inheritance': True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = 'furo'
html_title = f'composer-join {release}'
html_static_path: list[str] = []
