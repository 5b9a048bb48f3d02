"""Check the registry of Hugging Face RMS norm classes against the installed transformers.

``dattri_llm/gradient/layers/hf_classes.py`` lists, per form, the ``*RMSNorm`` classes whose
source matches the form's reference class (``LlamaRMSNorm``, ``Olmo2RMSNorm``, ``GemmaRMSNorm``).
This groups every ``*RMSNorm`` of the installed transformers by normalised source (docstrings,
comments, hints, names and default eps removed) and prints, per form, the classes to add and
to remove, then the forms the registry does not know. Run it after upgrading transformers:

    python -m experiments.hf_norm_classes
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from dattri_llm.gradient.layers.hf_classes import hf_norm_classes

REFERENCES = {"llama": "LlamaRMSNorm", "olmo2": "Olmo2RMSNorm", "gemma": "GemmaRMSNorm"}


def normalised_source(src: str, node: ast.ClassDef) -> str:
    """The class's source with what cannot change its maths taken out."""
    text = ast.get_source_segment(src, node) or ""
    text = re.sub(r'""".*?"""', "", text, flags=re.S)
    text = re.sub(r"#.*", "", text)
    text = re.sub(r"\bclass \w+", "class _", text)
    text = re.sub(r"\b\w+RMSNorm\b", "_Norm", text)
    text = re.sub(r"def extra_repr.*", "", text, flags=re.S)
    text = re.sub(r"eps\s*(:\s*float\s*)?=\s*[0-9.e-]+", "eps=_", text)
    text = re.sub(r"\s*->\s*(None|torch\.Tensor)", "", text)
    text = re.sub(r"hidden_states: torch\.Tensor", "hidden_states", text)
    return " ".join(text.split())


def groups() -> dict[str, list[str]]:
    """``{normalised source: [class names]}`` over the installed transformers."""
    import transformers

    found: dict[str, list[str]] = {}
    for path in sorted(Path(transformers.__file__).parent.glob("models/*/modeling_*.py")):
        src = path.read_text(encoding="utf-8")
        for node in ast.parse(src).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("RMSNorm"):
                found.setdefault(normalised_source(src, node), []).append(node.name)
    return found


def main() -> None:
    """Print the registry's differences from the installed transformers."""
    import transformers

    registered = hf_norm_classes()
    by_source = groups()
    known: set[str] = set()
    for form, reference in REFERENCES.items():
        members = next((set(v) for v in by_source.values() if reference in v), set())
        known |= members
        listed = {name for name, f in registered.items() if f.name == form}
        print(f"{form} ({reference}): {len(members)} classes in transformers "
              f"{transformers.__version__}, {len(listed)} registered")  # fmt: skip
        print(f"  to add:    {sorted(members - listed) or 'none'}")
        print(f"  to remove: {sorted(listed - members) or 'none'}")
    other = [sorted(v) for v in by_source.values() if not set(v) & known]
    print(f"other forms (not registered): {sum(map(len, other))} classes in {len(other)} groups")
    for names in sorted(other, key=len, reverse=True):
        print(f"  {', '.join(names)}")


if __name__ == "__main__":
    main()
