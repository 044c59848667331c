"""Transfers are immutable in the database itself: PostgreSQL refuses UPDATE and DELETE on them
by trigger (TRUNCATE, which only a test flush uses, stays possible). SQLite, the embedded
default, refuses UPDATE; it keeps DELETE for its test flush, and the model refuses deletes."""

from django.db import migrations

POSTGRES = """
CREATE OR REPLACE FUNCTION billing_transfer_immutable() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'billing transfers are immutable: post a correcting transfer instead';
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER billing_transfer_no_update BEFORE UPDATE OR DELETE ON billing_transfer
    FOR EACH ROW EXECUTE FUNCTION billing_transfer_immutable();
"""
POSTGRES_REVERSE = """
DROP TRIGGER IF EXISTS billing_transfer_no_update ON billing_transfer;
DROP FUNCTION IF EXISTS billing_transfer_immutable();
"""
SQLITE = [
    """CREATE TRIGGER billing_transfer_no_update BEFORE UPDATE ON billing_transfer
       BEGIN SELECT RAISE(ABORT, 'billing transfers are immutable: post a correcting transfer instead'); END;""",
]
SQLITE_REVERSE = [
    "DROP TRIGGER IF EXISTS billing_transfer_no_update;",
    "DROP TRIGGER IF EXISTS billing_transfer_no_delete;",
]


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRES)
    elif schema_editor.connection.vendor == "sqlite":
        for statement in SQLITE:
            schema_editor.execute(statement)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRES_REVERSE)
    elif schema_editor.connection.vendor == "sqlite":
        for statement in SQLITE_REVERSE:
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [("billing", "0001_initial")]
    operations = [migrations.RunPython(forwards, backwards)]
