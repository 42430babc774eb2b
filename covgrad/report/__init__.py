"""The run report: the stores' numbers as markdown, self-contained HTML and PNG plots.

``document`` renders (markdown, HTML, headline), ``plots`` draws (arrays in, PNG bytes out) and
``sections`` reads one run's stores section by section; ``render_report`` puts them together. Nothing
here opens a file: the caller hands over a :class:`~covgrad.report.sections.RunSource`
(``storage.stores.reports.RunArtifacts``), and ``storage.stores.reports.write_report`` writes the result.

Files in the report artifact: ``report.md`` (plots as relative PNG links), ``report.html`` (PNGs as
base64 data URIs), ``headline.md`` (the table the CLI prints), ``report.json`` (every number of the
headline and off-policy tables, unformatted) and one PNG per plot.
"""

from covgrad.report.document import Report
from covgrad.report.sections import RunSource, render_report

__all__ = ["Report", "RunSource", "render_report"]
