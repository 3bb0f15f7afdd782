"""The inline stylesheet and script of the ``--trace`` HTML view (html.py), read
from this package's ``static/`` data (trace.css, trace.js).

No external resource of any kind: the page reads its data from the JSON block
``<script type="application/json" id="dlm-trace">`` and draws everything itself
(DOM for the tokens, a <canvas> per canvas/block for the step-by-position
overview). Token text is only ever set as text, never parsed as HTML.
"""

from importlib.resources import files

_STATIC = files(__package__) / "static"
# The leading newline keeps the page byte-identical to when these were inline strings.
CSS = "\n" + (_STATIC / "trace.css").read_text(encoding="utf-8")
JS = "\n" + (_STATIC / "trace.js").read_text(encoding="utf-8")
