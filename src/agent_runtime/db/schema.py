"""Schema migrations with Alembic, driven from code (no alembic.ini to ship or find).

``upgrade`` brings a DB to the newest revision; ``status`` says where it is. Server mode calls
``status`` at start and refuses a schema that is behind; local mode upgrades itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

MIGRATIONS_DIR = Path(__file__).with_name("migrations")


def _config(engine: Engine | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["engine"] = engine
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None, "no migrations found"
    return head


@dataclass(frozen=True)
class SchemaStatus:
    current: str | None
    head: str

    @property
    def up_to_date(self) -> bool:
        return self.current == self.head

    def describe(self) -> str:
        return f"schema at {self.current or 'empty'}, code expects {self.head}"


def status(engine: Engine) -> SchemaStatus:
    """Blocking: run it on the DB thread pool."""
    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    return SchemaStatus(current=current, head=head_revision())


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Blocking: migrate ``engine``'s database to ``revision``."""
    command.upgrade(_config(engine), revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Blocking: take ``engine``'s database back to ``revision`` (tests of the migrations)."""
    command.downgrade(_config(engine), revision)
