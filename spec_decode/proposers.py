"""The plugin entry (pyproject.toml's "research_lm.proposers" entry point): which module registers each speculative
method, imported when that method is first asked for. A new proposer is a module that decorates its factory with
`@research_lm.worker.spec.register_proposer("<method>")`, plus its line here.
"""

from research_lm.worker.spec import PROPOSERS

PROPOSERS.add_module("ngram", "spec_decode.ngram")
PROPOSERS.add_module("draft_model", "spec_decode.draft_model")
PROPOSERS.add_module("eagle", "spec_decode.eagle")
PROPOSERS.add_module("eagle3", "spec_decode.eagle")
PROPOSERS.add_module("medusa", "spec_decode.medusa")
PROPOSERS.add_module("suffix", "spec_decode.suffix")
PROPOSERS.add_module("mtp", "spec_decode.mtp")
PROPOSERS.add_module("deepseek_mtp", "spec_decode.mtp")
