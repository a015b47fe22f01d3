"""The fixed English word lists the long-context tasks draw from (caramba.evaluation.tasks).

RULER draws needle keys as "adjective-noun" pairs and common-words lists from the `wonderwords`
package's lists; these are caramba's own, fixed in the source so that a task's text never depends
on an installed package's version. Changing a list changes generated text: bump
`caramba.evaluation.tasks.GENERATOR_VERSION` with it.
"""

from __future__ import annotations

ADJECTIVES = tuple("""
able absent abstract absurd academic acidic active actual adorable advanced afraid agile alert
alive amber ancient angry annual anxious aquatic arctic arid artistic ashamed asleep atomic
august average awake aware awful awkward bashful basic bitter bizarre blank bleak blind blissful
blond bloody blunt bold boring bouncy brave brief bright brilliant brisk broad broken bronze
brown bumpy busy calm candid capable careful casual cautious central certain charming cheap
cheerful chilly chosen chubby civic classic clean clever cloudy clumsy coarse cold colossal
comfy common compact complex concrete confused constant cosmic costly cozy crazy creamy creative
crimson crisp crooked crowded cruel crystal cuddly curious curly curved cute damp dapper daring
dark dazzling dead deadly decent deep defiant delicate dense dental desert digital dirty distant
dizzy dreamy dreary drowsy dusty dutiful eager early earnest easy eerie elastic elderly electric
elegant eminent empty endless enormous equal erratic ethical exact excited exotic expert faded
faint fair faithful famous fancy fearful feeble festive fierce filthy final firm flaky flashy
flawless fluffy foggy foolish formal fragile frail frantic free fresh friendly frozen frugal
funny fuzzy gentle genuine giant gifted gigantic gleaming glossy golden graceful grand grateful
greasy great greedy green grim grumpy guilty hairy handsome happy hardy harsh hasty healthy
hearty heavy helpful hidden hollow holy honest hopeful huge humble humid hungry icy ideal idle
immense immune jagged jealous jolly joyful juicy jumbo junior keen kind knotty lame large lavish
lazy leafy lean legal lethal level light likely limp little lively livid lonely loose loud lousy
loyal lucky lumpy lush magic major massive mature meager medical mellow merry messy mighty
mild minor misty modern modest moist moody mortal muddy murky musty mutual narrow nasty native
naughty neat needy nervous neutral nimble noble noisy normal nutty obedient obscure odd ominous
orange ornate oval pale paltry partial patient peaceful perfect petty phony pink plain pleasant
plump polite poor precious pretty prickly proud public puny pure purple quaint quick quiet
radiant ragged rapid rare raspy rational recent regular remote rigid ripe robust rocky rosy
rotten rough round royal rural rusty sacred salty sandy savage scarce scary secret serene
severe shabby shaggy sharp shiny short shrill shy silent silky silly simple sincere skinny sleepy
slim slimy slow small smart smoggy smooth snappy sneaky snowy soggy solar solid somber sour
sparkling spicy spiky spotless square stable stale steady steep sticky stiff stingy stormy
strange strict striped strong stubborn sturdy subtle sudden sunny super superb swanky sweet
swift tame tangible tart tasty tedious tender tense terrible thick thin thirsty thorny tidy
timely tiny tired torn tough tragic tranquil tricky trivial tropical true trusty twin ugly
ultimate unique upbeat urban useful vacant vague valid vast velvet vibrant vicious violet
virtual visible vital vivid wacky wary watery weary wicked wide wild willing windy wise witty
wobbly wooden woolly worried worthy yellow young youthful zany zealous
""".split())

NOUNS = tuple("""
abbey acorn actor advice agenda airport album alley almond anchor angle ankle antenna anthem
apple apricot apron archer arena armchair arrow artist attic auction author avocado badge
bakery balcony ballet bamboo banana bandage banjo banner barley barn barrel basket bathtub
battery beach beacon bean beard beaver bedroom beetle bell belt bench berry bicycle biscuit
blanket blender blizzard blossom blueprint boat bonnet bookcase boot bottle boulder bouquet
bowl bracelet branch bread breeze brick bridge broccoli brook broom bubble bucket budget buffalo
bulb bundle bunker butter button cabbage cabin cabinet cactus cake camel camera canal candle
canoe canyon captain caravan carpet carrot cartoon castle catalog cathedral cattle cellar cello
cereal chair chalk channel chapel charcoal cherry chess chicken chimney chisel chocolate church
cider cinema circus citizen clarinet classroom cliff clinic clock closet cloud clover coach coast
cobweb coconut coffee collar comet compass concert cookie copper coral corridor costume cottage
cotton couch counter county cousin cradle crater crayon creek cricket crown crystal cucumber
cupboard curtain cushion cycle dagger daisy dancer deck delta dentist desk dessert diamond
diary dinner dinosaur diploma doctor dolphin donkey dragon drawer dream dress drum duck dune
eagle easel eclipse elbow elephant elevator ember emerald engine envelope eraser estate falcon
farmer feather fence ferry festival fiddle field finger fireplace fish flag flamingo flannel
flute forest fork fossil fountain fox frame freezer fridge frog galaxy gallery garage garden
garlic gazelle gecko geyser ghost ginger giraffe glacier glove goat goblet gondola gorilla
grape grocery guitar gutter hammer hamster handle harbor harp hatchet hawk hazel helmet hermit
highway hill hippo hobby honey horizon hornet hospital hotel hunter hurricane iceberg igloo
index insect island ivory jacket jaguar jam jeans jelly jewel journal jungle kangaroo kayak
kettle kitchen kite kitten knight ladder ladle lagoon lake lamp lantern laptop lawyer leather
lemon leopard letter library lighthouse lily lizard lobster locket lumber magnet mailbox mango
mansion maple marble market meadow melon mermaid meteor mirror mitten monastery monkey moose
mosaic motor mountain muffin museum mushroom napkin necklace nectar needle nest novel nugget
oasis ocean octopus office olive onion orbit orchard orchestra otter oven owl oyster paddle
painter palace panda panther parade parcel parrot passport pasta peach peacock peanut pebble
pelican pencil penguin pepper piano pickle pigeon pillow pilot pineapple pirate planet plank
plaza plum poem pony poodle porch portrait potato pottery prairie prism pudding pumpkin puppet
puzzle pyramid quarry quartz quilt rabbit raccoon radar radio radish raft railway raincoat
raisin ranch raven recipe reef rhino ribbon riddle river robin rocket rooster rose ruby saddle
sailor salad salmon sandal satellite saucer sausage saxophone scarf scholar scissors scooter
sculpture seagull shadow shark shelf shell shepherd shovel shrimp sketch skyline sled slipper
snail sofa soldier sparrow spider spinach sponge spoon squirrel stadium stairway statue stove
strawberry stream studio submarine subway suitcase summit sunflower swamp sweater swing tablet
tailor tangerine teacher teapot telescope temple tennis tent theater thimble thunder ticket
tiger timber toaster tomato tornado tortoise tower tractor trail train treasure trolley trophy
trumpet tulip tunnel turkey turtle umbrella unicorn valley vase vessel village violin volcano
wagon wallet walnut walrus wardrobe warrior waterfall weasel whale wheat whistle willow window
wizard wolf yacht yogurt zebra zipper
""".split())

VERBS = tuple("""
absorb accept achieve admire advise afford agree allow amuse announce annoy appear applaud
approve argue arrange arrive attach attack attend avoid bake balance bathe battle beg behave
belong blink boast boil bounce breathe bruise brush bubble build bury calculate carve celebrate
challenge change charge chase cheat cheer chew choke chop clap climb collect comb compare
complain confess connect consider contain continue copy correct cough crawl crush cycle dance
decide deliver depend describe deserve destroy develop disagree discover divide doubt drag drain
dress drift drown educate embrace employ encourage enjoy escape examine excuse exercise exist
expand explain explode extend fasten fetch file fix flash float flood flow fold follow frighten
gather gaze giggle glow grab grease greet grin grip groan guard guess guide hammer handle happen
harass hover hug hunt hurry identify ignore imagine impress improve include inform inject inspect
invent invite itch jog joke judge juggle kneel knit knock label land launch laugh learn lick
listen melt memorize mend milk mourn multiply murmur nail navigate nest nod notice obey observe
obtain occur offend offer open organize overflow paddle paint pause peel perform permit persuade
pinch plant pledge plug polish pour praise pray preach prefer prepare present preserve pretend
prevent print produce promise protect provide pull pump punch punish push question queue race
radiate rain realize receive recognize record reduce reflect refuse regret reign reject rejoice
relax release remain remember remind repair repeat replace reply report request rescue retire
return rhyme rinse risk roll rub ruin sail satisfy scare scatter scold scrape scratch scream
screw scribble search settle shave shelter shiver shock shrug sigh signal skate sketch ski skip
slap sneeze sniff snore soothe sparkle spell spray sprout squash squeak squeeze stamp stare
steer stitch stretch strip stroke stuff subtract succeed suffer suggest supply support suppose
surprise surround suspect swim tame taste tease telephone tempt terrify thank thaw tickle tickle
tie tip tour tow trace trade train transport trap travel treat tremble trust tumble twist type
unfasten unite unlock unpack untidy vanish visit wail wander wash waste watch wave weigh welcome
whine whisper whistle wink wobble wonder worry wrap wreck wrestle wriggle yawn yell zoom
""".split())
