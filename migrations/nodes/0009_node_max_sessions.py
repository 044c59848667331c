from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0008_used_join_token"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="max_sessions",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
    ]
