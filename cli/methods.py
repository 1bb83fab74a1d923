import typer

from gndpo.cli.common import echo_table
from gndpo.pipeline.methods import METHODS, MODIFIERS


def methods():
    """List the methods (method.name), their default loss and what they need from score."""
    echo_table([
        {"method": m.name, "policy_loss": m.policy_loss, "loss_agg": m.loss_agg,
         "score_extras": ",".join(sorted(m.needs)) or "-", "what": m.summary}
        for m in METHODS.values()
    ])
    typer.echo("modifiers (any method): " + ", ".join(f"{m.name} ({m.knob})" for m in MODIFIERS))
