"""The prompts ``speculative.py`` runs: draftable ones (short and long), novel questions and a
multi-turn conversation.

The texts are public domain (the opening of Lewis Carroll's *Alice's Adventures in Wonderland*,
chapter 1) or written for the benchmark (a class, meeting minutes, a recipe, the questions), and
fixed, so a run on another day answers the same prompts.
"""

from __future__ import annotations

# The opening paragraphs of chapter 1, in order.
ALICE = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
    "once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations "
    "in it, and what is the use of a book, thought Alice, without pictures or conversations?",
    "So she was considering in her own mind (as well as she could, for the hot day made her feel very sleepy and "
    "stupid), whether the pleasure of making a daisy-chain would be worth the trouble of getting up and picking "
    "the daisies, when suddenly a White Rabbit with pink eyes ran close by her.",
    "There was nothing so very remarkable in that; nor did Alice think it so very much out of the way to hear the "
    "Rabbit say to itself, Oh dear! Oh dear! I shall be late! (when she thought it over afterwards, it occurred to "
    "her that she ought to have wondered at this, but at the time it all seemed quite natural); but when the Rabbit "
    "actually took a watch out of its waistcoat-pocket, and looked at it, and then hurried on, Alice started to her "
    "feet, for it flashed across her mind that she had never before seen a rabbit with either a waistcoat-pocket, "
    "or a watch to take out of it, and burning with curiosity, she ran across the field after it, and fortunately "
    "was just in time to see it pop down a large rabbit-hole under the hedge.",
    "In another moment down went Alice after it, never once considering how in the world she was to get out again.",
    "The rabbit-hole went straight on like a tunnel for some way, and then dipped suddenly down, so suddenly that "
    "Alice had not a moment to think about stopping herself before she found herself falling down a very deep well.",
    "Either the well was very deep, or she fell very slowly, for she had plenty of time as she went down to look "
    "about her and to wonder what was going to happen next. First, she tried to look down and make out what she "
    "was coming to, but it was too dark to see anything; then she looked at the sides of the well, and noticed "
    "that they were filled with cupboards and book-shelves; here and there she saw maps and pictures hung upon "
    "pegs. She took down a jar from one of the shelves as she passed; it was labelled ORANGE MARMALADE, but to "
    "her great disappointment it was empty: she did not like to drop the jar for fear of killing somebody "
    "underneath, so managed to put it into one of the cupboards as she fell past it.",
    "Well! thought Alice to herself, after such a fall as this, I shall think nothing of tumbling down stairs! How "
    "brave they'll all think me at home! Why, I wouldn't say anything about it, even if I fell off the top of the "
    "house! (Which was very likely true.)",
    "Down, down, down. Would the fall never come to an end? I wonder how many miles I've fallen by this time? she "
    "said aloud. I must be getting somewhere near the centre of the earth. Let me see: that would be four thousand "
    "miles down, I think (for, you see, Alice had learnt several things of this sort in her lessons in the "
    "schoolroom, and though this was not a very good opportunity for showing off her knowledge, as there was no "
    "one to listen to her, still it was good practice to say it over) yes, that's about the right distance, but "
    "then I wonder what Latitude or Longitude I've got to? (Alice had no idea what Latitude was, or Longitude "
    "either, but thought they were nice grand words to say.)",
)
CODE = (
    "class ShoppingCart:\n"
    "    def __init__(self, customer):\n"
    "        self.customer = customer\n"
    "        self.items = []\n"
    "\n"
    "    def add(self, name, price, quantity=1):\n"
    '        self.items.append({"name": name, "price": price, "quantity": quantity})\n'
    "\n"
    "    def remove(self, name):\n"
    '        self.items = [item for item in self.items if item["name"] != name]\n'
    "\n"
    "    def subtotal(self):\n"
    '        return sum(item["price"] * item["quantity"] for item in self.items)\n'
    "\n"
    "    def total(self, tax_rate):\n"
    "        subtotal = self.subtotal()\n"
    "        return subtotal + subtotal * tax_rate\n"
)
MINUTES = (
    "The committee met on Monday to review the budget. The committee agreed that the budget for the library "
    "would stay the same, and that the budget for the park would grow by ten percent."
)
# Short texts the answer repeats or lightly edits (about 60 words, or a short class). Asked to
# rename an attribute, SmolLM2-135M copies the code unrenamed: that is the answer greedy decoding
# gives, and the row measures it as it is.
DRAFTABLE = [
    f"Repeat the following paragraph exactly:\n\n{ALICE[0]}",
    f"Rewrite this Python class with the attribute `items` renamed to `products`. Output only the code.\n\n{CODE}",
    f"Repeat the following paragraph exactly:\n\n{MINUTES} " + MINUTES.replace("Monday", "Tuesday"),
    "Copy this list exactly:\n1. Preheat the oven to 180 degrees.\n2. Mix the flour, sugar and eggs in a bowl.\n"
    "3. Pour the batter into a greased tin.\n4. Bake for thirty minutes.\n5. Let the cake cool before serving.",
]
# Thirty steps of a recipe: a list of about 340 tokens.
RECIPE = (
    "Preheat the oven to 180 degrees.",
    "Grease a round cake tin with butter.",
    "Line the bottom of the tin with baking paper.",
    "Sift the flour and the baking powder into a bowl.",
    "Add a pinch of salt to the flour.",
    "Beat the butter and the sugar until pale.",
    "Add the eggs one at a time, beating well after each.",
    "Fold in the flour gently.",
    "Stir in the milk and the vanilla.",
    "Pour the batter into the tin.",
    "Smooth the top with a spatula.",
    "Bake for thirty minutes.",
    "Test the middle with a skewer.",
    "Let the cake cool in the tin for ten minutes.",
    "Turn it out onto a wire rack.",
    "Whip the cream with a little sugar.",
    "Slice the strawberries thinly.",
    "Cut the cake in half across the middle.",
    "Spread jam over the bottom half.",
    "Spread half of the cream over the jam.",
    "Put the top half back on.",
    "Spread the rest of the cream over the cake.",
    "Arrange the strawberries on top.",
    "Dust with icing sugar.",
    "Chill the cake for an hour.",
    "Wash the bowls and the whisk.",
    "Put the butter and the milk back in the fridge.",
    "Cut the cake into eight slices.",
    "Put each slice on a plate.",
    "Serve on the day it is made.",
)
# Passages of over 300 tokens to repeat. SmolLM2-135M repeats neither whole. The recipe: it copies
# the first seven steps, then writes steps of its own and loops on "Lay the cake on the bottom of the
# tin", numbering them, to the budget (the first divergence is a near-tie: top-two logit margins of
# 0.03 to 0.1, so another CPU's kernels may move it by a step). The story's first four paragraphs:
# it copies them with a paragraph left out, then starts over from the third and runs to the budget;
# asked first and then given the text, it summarizes and loops. That is the answer greedy decoding
# gives, and the row measures it as it is: ideal prompt lookup commits about 5 (recipe) and 6.6
# (story) tokens per pass of those answers, the ceiling of any n-gram plan (the benchmark's
# ``lookup`` column). A poem, a JSON array and the class above fared no better (2.4 to 7.9).
LONG = [
    "Copy this list exactly:\n" + "\n".join(f"{index}. {step}" for index, step in enumerate(RECIPE, 1)),
    "\n\n".join(ALICE[:4]) + "\n\nRepeat the text above exactly, word for word.",
]
NOVEL = [
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me some ideas for a weekend trip in the mountains.",
    "How does a bicycle stay upright when it moves?",
]

# A conversation of about 1,000 tokens in the model's chat template: a system message, the
# chapter's opening as a user's document, an assistant's answer, then the first turn's question.
# The second turn appends the first turn's answer and FOLLOW_UP.
CONVERSATION = [
    {"role": "system", "content": "You are a careful reader. Answer questions about the text the user gives."},
    {"role": "user", "content": "Here is the opening of a story:\n\n" + "\n\n".join(ALICE) + "\n\nWho is Alice?"},
    {
        "role": "assistant",
        "content": "Alice is a girl who is sitting on a river bank with her sister on a hot day. She is bored, "
        "because her sister's book has no pictures or conversations. When a White Rabbit with a watch runs past, "
        "she follows it down a rabbit-hole and falls down a very deep well.",
    },
    {"role": "user", "content": "What does Alice find on the shelves as she falls?"},
]
FOLLOW_UP = "Why does she not drop the jar?"
