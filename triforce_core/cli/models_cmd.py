"""`triforce models`: what `--model` can name on this machine, offline."""
from __future__ import annotations

import json

import click


@click.command("models")
@click.option("--json", "as_json", is_flag=True, help="One JSON list instead of the table.")
def models(as_json):
    """List the models that can run here: the default model, the Hugging Face cache's snapshots
    (`--model ORG/NAME`, or ORG/NAME@REVISION; HF_HOME / HF_HUB_CACHE move the cache) and
    Ollama's models (`--model ollama:NAME:TAG`; OLLAMA_MODELS moves its store), with format, size
    and whether triforce runs them. Nothing is downloaded."""
    from triforce.model.model_names import available

    found = available()
    if as_json:
        click.echo(json.dumps(found, indent=1))
        return
    width = max(len(m["model"]) for m in found)
    for m in found:
        size = f"{m['bytes'] / 1e6:,.0f} MB" if m["bytes"] is not None else "-"
        verdict = m["note"] if m["runs"] else f"does not run: {m['note']}"
        click.echo(f"{m['model']:<{width}}  {m['format']:<11}  {size:>10}  {verdict}")
