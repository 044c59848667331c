from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0014_node_under_review"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="recent_failures",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="node",
            name="failures_since",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="node",
            name="failures_total",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="node",
            name="routing_backoff_until",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="node",
            name="recent_deliberate",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="node",
            name="last_failure_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="node",
            name="last_failure",
            field=models.CharField(blank=True, max_length=255),
        ),
    ]
