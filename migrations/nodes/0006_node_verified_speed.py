from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0005_node_soft_delete"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="verified_layer_tokens_per_s",
            field=models.FloatField(blank=True, null=True),
        ),
    ]
