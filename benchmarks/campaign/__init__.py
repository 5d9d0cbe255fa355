"""The GPU campaign: f8tensor's checks, figures and GPU tests in one command on a lent GPU.

A GPU is lent rarely and briefly (one command of at most 480 s, an optional second one of
at most 240 s, no network, at most 8 files back per command), so the campaign is a plan of
items ordered by value, each with its own deadline, run by one process under one budget
counted from process start, with its files rewritten after every item: a run cut off
anywhere returns what it measured. ``benchmarks/gpu_campaign.py`` is the command.

Modules (one item family each; read one to read an item):

- ``runner``: items, deadlines, the watchdog, child processes, absent packages.
- ``plans``: the default and the second plan, with planned seconds.
- ``environment``: the environment line (``_common.environment`` plus torchao's origin).
- ``smoke``, ``llama``, ``linear``, ``moe``, ``references``, ``gpu_tests``: the default plan's items.
- ``e2e`` (the 300m), ``overhead``, ``profiles``, ``vit``, ``hooks``: the second plan's.
- ``targets``: the targets, as data; ``report``: the CSV and the summary.
- ``measure``: timing and SQNR pieces the items share.
"""
