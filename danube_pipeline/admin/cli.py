"""``danube-admin``: the operator's command line for a running Danube cluster.

Every verb does its work for real, inside one ``asyncio.run``: through the client library
(:class:`~danube_pipeline.client.DanubeClient`, which talks to the brokers) or straight to etcd
through :class:`~danube_pipeline.metadata.store.MetadataStore` (the keys of
``docs/etcd-layout.md``). Root options, before the verb::

    danube-admin [--etcd-endpoints H:P,...] [--brokers H:P,...] [--output text|json] GROUP VERB ...

``--etcd-endpoints`` defaults to ``$DANUBE_ETCD_ENDPOINTS`` (``127.0.0.1:2379``), ``--brokers``
(bootstrap brokers) to ``$DANUBE_BROKER_ADDRESSES`` (``127.0.0.1:6650``), as in
:mod:`danube_pipeline.settings`. ``--output text`` (default) prints aligned tables for people;
``--output json`` prints exactly one JSON document on stdout (ids are bare JSON integers, usually
above 2^53, as in etcd: ``docs/etcd-layout.md``, "Conventions").

Each command group is a module of this package, whose docstring lists its verbs and the JSON
each prints (``owner`` objects are ``{"broker_id": int, "address": "host:port"}``):
:mod:`~danube_pipeline.admin.brokers`, :mod:`~danube_pipeline.admin.namespaces`,
:mod:`~danube_pipeline.admin.topics`, :mod:`~danube_pipeline.admin.subscriptions` and
:mod:`~danube_pipeline.admin.security` (tokens, roles, bindings). This
module holds the root group with its options and :func:`main`.

Not available yet, because the broker cannot do it: deleting a subscription.

Errors, as one ``error: ...`` line on stderr and never a traceback:

* exit 2: bad arguments, e.g. a malformed topic or namespace name (the "Name grammar" of
  ``docs/etcd-layout.md``), a negative or non-integer policy value, an unknown broker id or
  address, a malformed endpoint (``click.UsageError`` / ``click.BadParameter``);
* exit 1: a :class:`~danube_pipeline.errors.DanubeError` from the cluster (e.g. ``topic
  '/default/x' not found``, an unreachable broker or etcd), a policy changed by someone else
  during ``set-policy``, or a stored policy that does not parse.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NoReturn

import click

from danube_pipeline import settings
from danube_pipeline.admin import brokers, namespaces, security, subscriptions, topics
from danube_pipeline.admin.arguments import is_address
from danube_pipeline.admin.config import Config
from danube_pipeline.errors import DanubeError, InvalidNameError, MetadataStoreError
from danube_pipeline.metadata.etcd import split_endpoint

__all__ = ["cli", "main"]


# ---------------------------------------------------------------------------- root options


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _parse_endpoints(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    endpoints = [part.strip() for part in value.split(",") if part.strip()]
    if not endpoints:
        raise click.BadParameter("no etcd endpoint given", ctx=ctx, param=param)
    for endpoint in endpoints:
        try:
            split_endpoint(endpoint)
        except MetadataStoreError:
            raise click.BadParameter(f"{endpoint!r} is not host:port", ctx=ctx, param=param) from None
    return endpoints


def _parse_brokers(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    addresses = [part.strip() for part in value.split(",") if part.strip()]
    if not addresses:
        raise click.BadParameter("no broker address given", ctx=ctx, param=param)
    for address in addresses:
        if not is_address(address):
            raise click.BadParameter(f"{address!r} is not host:port", ctx=ctx, param=param)
    return addresses


# ---------------------------------------------------------------------------- root


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--etcd-endpoints",
    default=lambda: ",".join(settings.etcd_endpoints()),
    show_default="$DANUBE_ETCD_ENDPOINTS or 127.0.0.1:2379",
    callback=_parse_endpoints,
    help="Comma-separated etcd endpoints (host:port).",
)
@click.option(
    "--brokers",
    default=lambda: ",".join(settings.broker_addresses()),
    show_default="$DANUBE_BROKER_ADDRESSES or 127.0.0.1:6650",
    callback=_parse_brokers,
    help="Comma-separated bootstrap brokers (host:port), used to learn the cluster.",
)
@click.option(
    "--output",
    "-o",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="text: aligned tables; json: one JSON document on stdout.",
)
@click.pass_context
def cli(ctx: click.Context, etcd_endpoints: list[str], brokers: list[str], output: str) -> None:
    """Administer a Danube cluster: brokers, namespaces, topics, subscriptions.

    Not available yet (the broker cannot do it): deleting a subscription. The etcd keys are
    described in docs/etcd-layout.md.
    """
    ctx.obj = Config(etcd_endpoints=etcd_endpoints, brokers=brokers, output=output)


cli.add_command(brokers.brokers)
cli.add_command(namespaces.namespaces)
cli.add_command(topics.topics)
cli.add_command(subscriptions.subscriptions)
cli.add_command(security.security)


# ---------------------------------------------------------------------------- entry point


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"error: {_one_line(message)}", err=True)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run ``danube-admin`` and exit: 0 on success, 2 for bad arguments, 1 for a refusal by the
    cluster (each error as one ``error: ...`` line on stderr, never a traceback)."""
    try:
        result = cli.main(
            args=list(argv) if argv is not None else None, prog_name="danube-admin", standalone_mode=False
        )
    except click.exceptions.NoArgsIsHelpError as exc:  # a group named without a verb: its help
        click.echo(exc.format_message(), err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        _fail("interrupted", 130)
    except click.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except InvalidNameError as exc:
        _fail(str(exc), 2)
    except DanubeError as exc:
        _fail(str(exc), 1)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except BrokenPipeError:
        sys.exit(1)
    except Exception as exc:  # never a traceback; say what broke
        _fail(f"unexpected {type(exc).__name__}: {exc}", 1)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
